"""A search space described by costs only: what the planner simulates and the profiler measures.

Per block, per candidate: forward and backward milliseconds and whether it holds state (an
optimizer update); plus the run's overheads, which depend on the machine rather than the space.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_naspipe.planning.links import Link, LinkModel

__all__ = ["BlockSpec", "CandidateSpec", "SpaceSpec", "block_cost_ms", "candidate_ms", "wide_spec"]

_OVERHEADS = ("update_ms", "action_overhead_ms", "message_ms", "message_cpu_ms", "parallel_slowdown",
              "step_overhead_ms", "subnet_overhead_ms", "sync_ms", "message_ms_per_mb", "reduce_hops",
              "grad_tensor_ms", "statistics_tensor_ms", "replica_spread")


def candidate_ms(seconds: Sequence[float]) -> float:
    """A candidate's cost from its timed rounds: their median, in milliseconds.

    The median, not the fastest: a training run pays the typical time of an op (cache misses, page
    faults and all), and the fastest of a few rounds undercounts it by 10-15% (seen on a wide MLP).
    """
    return 1000 * statistics.median(seconds)


def block_cost_ms(candidates_ms: Sequence[float]) -> float:
    """A block's cost from its candidates' costs: their mean (what a uniform pick costs on average)."""
    return sum(candidates_ms) / len(candidates_ms)


@dataclass
class CandidateSpec:
    """One candidate op: ``forward_ms``/``backward_ms`` per subnet batch; ``stateful``: parameters or buffers;
    ``buffers``: buffers, which a training forward may change (its forward then never runs ahead);
    ``input_backward_ms``/``weight_backward_ms``: its backward's two passes on a stage that defers weight
    gradients (``None``: not measured, and a stage holding it is modelled as never deferring); ``grad_bytes``: its
    trainable parameters' gradient bytes, which data-parallel replicas exchange in every update; ``grad_tensors`` and
    ``statistics_tensors``: how many tensors those are, and how many BatchNorm running-statistics buffers it has
    (the replicas' update packs, sends and unpacks each); ``replay_ms``: replaying its BatchNorm running-statistics
    updates for one subnet batch, which every later replica does in each update (0: none)."""

    forward_ms: float
    backward_ms: float
    stateful: bool = True
    buffers: bool = False
    input_backward_ms: float | None = None
    weight_backward_ms: float | None = None
    grad_bytes: int = 0
    grad_tensors: int = 0
    statistics_tensors: int = 0
    replay_ms: float = 0.0

    @property
    def deferred_ms(self) -> tuple[float, float] | None:
        """``(input_backward_ms, weight_backward_ms)`` when both are measured."""
        if self.input_backward_ms is None or self.weight_backward_ms is None:
            return None
        return self.input_backward_ms, self.weight_backward_ms


@dataclass
class BlockSpec:
    """A block: candidates; ``label`` ``None`` means a fixed block (exactly one candidate)."""

    label: str | None
    candidates: list[CandidateSpec]

    def pick(self, architecture: Mapping[str, int]) -> int:
        """The candidate a subnet (label -> candidate) takes here: its label's, or 0 in a fixed block."""
        return 0 if self.label is None else architecture[self.label]

    @property
    def cost_ms(self) -> float:
        """Forward plus backward of a uniform pick: :func:`block_cost_ms` of the candidates."""
        return block_cost_ms([c.forward_ms + c.backward_ms for c in self.candidates])


@dataclass
class SpaceSpec:
    """A search space by costs. Blocks sharing a label share one decision, as in the supernet.

    Attributes:
        blocks: the blocks in order.
        update_ms: optimizer step cost per stateful resource a subnet updates on a stage.
        action_overhead_ms: the engine's own cost per action (F/B per chunk, and U).
        message_ms: latency of a cross-stage message (activation or gradient).
        message_cpu_ms: a stage's own time per message it sends or receives (serialising, copying).
        parallel_slowdown: compute time multiplier while every stage computes at once (stages sharing
            one host's cores, memory bandwidth or caches); 1 for independent devices. Applied in
            proportion to how busy the stages are (a fixed point over the simulation).
        step_overhead_ms: fixed cost per window (Lightning's loop, building the schedule).
        subnet_overhead_ms: cost per subnet outside the pipeline (Lightning's logging and optimizer wrapper).
        sync_ms: extra fixed cost per window with several stages (sharing losses, awaiting sends).
        message_ms_per_mb: a message's cost per MB of payload beyond ``message_ms`` (copies, and for the
            replicas' reduction, the additions); the planner charges it for the replicas' gradient messages.
        reduce_hops: ``2 (replicas - 1)``, the hops of each update's chained reduction among data-parallel
            replicas, streamed in pieces (:func:`.links.streamed_chain_ms`); set by the planner when it simulates
            one replica (0: no replicas).
        replica_links: the links between replicas (:class:`.links.LinkModel`); ``None``: every hop costs
            ``message_ms + message_cpu_ms`` per message and ``message_ms_per_mb`` per MB (one host).
        grad_tensor_ms: a replica update's own time per gradient tensor and hop (packing, unpacking, copying).
        statistics_tensor_ms: the same per BatchNorm running-statistics buffer (saved, sent, loaded).
        replica_spread: a replica's per-subnet compute time's relative standard deviation (noise, other
            processes): every update waits for the slowest of its replicas, the expected maximum of ``D`` draws.
    """

    blocks: list[BlockSpec]
    update_ms: float = 0.05
    action_overhead_ms: float = 0.0
    message_ms: float = 0.0
    message_cpu_ms: float = 0.0
    parallel_slowdown: float = 1.0
    step_overhead_ms: float = 0.0
    subnet_overhead_ms: float = 0.0
    sync_ms: float = 0.0
    message_ms_per_mb: float = 0.0
    reduce_hops: float = 0.0
    replica_links: LinkModel | None = None
    grad_tensor_ms: float = 0.0
    statistics_tensor_ms: float = 0.0
    replica_spread: float = 0.0

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a SpaceSpec needs at least one block")
        for name in _OVERHEADS:
            if not getattr(self, name) >= (1 if name == "parallel_slowdown" else 0):
                raise ValueError(f"{name} must be >= {int(name == 'parallel_slowdown')}, got {getattr(self, name)!r}")
        for i, block in enumerate(self.blocks):
            if not block.candidates or (block.label is None and len(block.candidates) != 1):
                raise ValueError(f"block {i} needs candidates, and exactly one when it is fixed (label None)")
            if any(not (c.forward_ms >= 0 and c.backward_ms >= 0 and c.replay_ms >= 0)
                   or not all(t >= 0 for t in c.deferred_ms or ()) for c in block.candidates):
                raise ValueError(f"block {i} has a negative or NaN cost")
        self.labels()  # equal candidate counts per label

    def labels(self) -> dict[str, int]:
        """Label -> candidate count, in first-appearance order (like ``Supernet.labels``)."""
        labels: dict[str, int] = {}
        for i, block in enumerate(self.blocks):
            if block.label is not None and labels.setdefault(block.label, len(block.candidates)) != len(
                    block.candidates):
                raise ValueError(f"blocks sharing label {block.label!r} have different candidate counts (block {i})")
        return labels

    def compute_scaled(self, scale: Callable[[float], float]) -> SpaceSpec:
        """A copy with ``scale`` applied to every candidate's compute milliseconds (forward, backward, the
        deferred backward's two passes where measured, the statistics replay); the update and the overheads as they
        are."""
        def scaled(ms: float | None) -> float | None:
            return None if ms is None else scale(ms)

        return replace(self, blocks=[BlockSpec(b.label, [
            replace(c, forward_ms=scale(c.forward_ms), backward_ms=scale(c.backward_ms),
                    input_backward_ms=scaled(c.input_backward_ms), weight_backward_ms=scaled(c.weight_backward_ms),
                    replay_ms=scale(c.replay_ms))
            for c in b.candidates]) for b in self.blocks])

    def to_json(self) -> str:
        """Serialise to JSON (see :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> SpaceSpec:
        """Parse :meth:`to_json`'s output."""
        data = json.loads(text)
        blocks = [BlockSpec(b["label"], [CandidateSpec(**c) for c in b["candidates"]]) for b in data.pop("blocks")]
        links = data.pop("replica_links", None)
        if links is not None:
            links = LinkModel(Link(**links["intra"]), Link(**links["inter"]), links["per_node"])
        return cls(blocks, **data, replica_links=links)


def wide_spec(candidates: int, blocks: int = 8, block_ms: float = 1.0, backward_ratio: float = 2.0,
              **overheads: Any) -> SpaceSpec:
    """``benchmarks/overlap.py``'s shape: ``blocks`` choice blocks of ``candidates`` equal stateful ops."""
    op = CandidateSpec(block_ms, block_ms * backward_ratio, True)
    return SpaceSpec([BlockSpec(f"block{i}", [op] * candidates) for i in range(blocks)], **overheads)
