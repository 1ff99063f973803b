"""A short profile of a supernet's blocks: the :class:`~.space_spec.SpaceSpec` the planner predicts from.

Every candidate of every block is timed forward and backward (CPU wall time by default, after a
warm-up round) while training paths through the supernet that cycle through the candidates, so
inputs have the right shapes and caches are as cold as in training (:mod:`.block_cost`, reduced
with :func:`~.space_spec.candidate_ms`, as the stage split is). The optimizer step is timed as the
engine runs it, and the engine's own per-action overhead on a stand-in of 1x1 ops. It runs on a copy
of the supernet inside a forked RNG: the user's weights, gradients, buffers and the global RNG are
left untouched. The costs that depend on the run rather than the space (Lightning's loop, the
transport, shared cores) are passed in as ``**overheads``; ``benchmarks/overhead_harness.py``
measures them.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.transport.boundary import tensors_in
from lightning_naspipe.pipeline.engine import Engine
from lightning_naspipe.planning.block_cost import holds_state, time_paths
from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec
from lightning_naspipe.pipeline.sampling import uniform_architecture
from lightning_naspipe.space.choice import ChoiceBlock, candidates_of
from lightning_naspipe.space.supernet import BlockValue, Supernet

__all__ = ["profile_supernet"]

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def _default_optimizer(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def profile_supernet(supernet: Supernet, sample_input: BlockValue, repeats: int = 3,
                     optimizer: OptimizerFactory = _default_optimizer, clock: Callable[[], float] = time.perf_counter,
                     engine_seconds: float = 2.0, **overheads: float) -> SpaceSpec:
    """Time each block's candidates, the optimizer update and the engine's own overhead.

    Args:
        supernet: the search space (not modified).
        sample_input: what the first block receives for one subnet batch (``pipeline_input(batch)``);
            costs scale with its size, so use the training batch size (per chunk costs are derived).
        repeats: timed runs per candidate after one warm-up round; the median is kept.
        optimizer: builds the training optimizer over a list of parameters (default SGD with momentum);
            its step over a subnet's parameters, as the engine runs it, gives ``update_ms`` per resource.
        clock: seconds now; wall time by default. On a machine shared with other jobs,
            ``time.thread_time`` (this thread's CPU time) is steadier (one intra-op thread only).
        engine_seconds: then train sampled subnets with the one-stage engine for about this long (at
            least 16 subnets) and scale every compute cost so that the profile predicts that run: timed
            one at a time, blocks run 4-13% faster than in training, which cycles through every
            candidate's weights. ``0`` keeps the timed costs.
        **overheads: other :class:`SpaceSpec` fields (``message_ms``, ``step_overhead_ms``, ...), which
            depend on the run, not the space; ``action_overhead_ms`` defaults to the engine's, measured.

    Returns:
        The space's :class:`SpaceSpec`, blocks and labels as in ``supernet``.
    """
    with torch.random.fork_rng(devices=[]):
        blocks, update_ms = _profile_blocks(copy.deepcopy(supernet), sample_input, optimizer, repeats, clock)
        if "action_overhead_ms" not in overheads:
            overheads["action_overhead_ms"] = _engine_overhead(supernet, clock)
        spec = SpaceSpec(blocks, update_ms=update_ms, **overheads)
        if engine_seconds > 0:
            _scale_to_engine(spec, copy.deepcopy(supernet), sample_input, optimizer, clock, engine_seconds)
        return spec


def _profile_blocks(net: Supernet, x: Any, optimizer: OptimizerFactory, repeats: int,
                    clock: Callable[[], float]) -> tuple[list[BlockSpec], float]:
    """Per-candidate costs, and the update's per resource, training paths through every candidate."""
    ops = [candidates_of(b) for b in net.blocks]
    times = time_paths(ops, x, repeats, clock, optimizer(list(net.parameters())), deferred=True)
    blocks = [BlockSpec(block.label if isinstance(block, ChoiceBlock) else None,
                        [_candidate(times, i, k, op) for k, op in enumerate(ops[i])])
              for i, block in enumerate(net.blocks)]
    # The mean, not the median: a path's step cost swings with what its nested choices trained
    # (bimodal on cells), and a run pays the average.
    return blocks, 1000 * statistics.mean(times.update) if times.update else 0.0


class _NullModule:
    """The engine's view of a module whose compute is negligible: what remains is the engine's own work."""

    naspipe_seed = 0
    trainer = SimpleNamespace(lr_scheduler_configs=[], callback_metrics={})

    def __init__(self, supernet: Supernet) -> None:
        self.supernet = supernet
        self.optimizer = _default_optimizer(list(self.supernet.parameters()))

    def sample_subnet(self, index: int) -> dict[str, int]:
        return uniform_architecture(self.supernet.labels, self.naspipe_seed, index)

    def sample_step(self, step: int) -> list[dict[str, int]]:
        return [self.sample_subnet(step)]

    def pipeline_input(self, batch: Any) -> Any:
        return batch

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return output.sum()

    def manual_backward(self, loss: Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def optimizers(self) -> Any:
        return SimpleNamespace(optimizer=self.optimizer, step=self.optimizer.step)


def _candidate(times: Any, block: int, k: int, op: torch.nn.Module) -> CandidateSpec:
    forward_ms, backward_ms = times.cost_ms(block, k)
    input_ms, weight_ms = times.deferred_ms(block, k) or (None, None)
    return CandidateSpec(forward_ms, backward_ms, holds_state(op), any(True for _ in op.buffers()), input_ms, weight_ms,
                         sum(p.numel() * p.element_size() for p in op.parameters() if p.requires_grad))


def _engine_overhead(net: Supernet, clock: Callable[[], float], window: int = 4, subnets: int = 64) -> float:
    """Milliseconds per action the one-stage engine spends beyond the profiled compute (bookkeeping,
    sampling, scheduling, the loss call): a stand-in supernet with the same blocks, labels and candidate
    counts but 1x1 linear ops, trained by the engine, minus its own profile."""
    def tiny() -> nn.Module:
        return nn.Linear(1, 1)
    stand_in = Supernet(*[ChoiceBlock([tiny() for _ in b.candidates], b.label) if isinstance(b, ChoiceBlock)
                          else tiny() for b in net.blocks])
    module, engine = _NullModule(stand_in), Engine([range(len(stand_in))])
    blocks, update_ms = _profile_blocks(copy.deepcopy(stand_in), torch.zeros(1, 1), _default_optimizer, 2, clock)
    compute = sum(b.cost_ms for b in blocks)
    compute += update_ms * len(blocks)
    elapsed = []
    for _ in range(4):
        start = clock()
        for first in range(0, subnets, window):
            engine.train_window(module, [torch.zeros(1, 1)] * window, first)
        elapsed.append(clock() - start)
    return max(0.0, (1000 * statistics.median(elapsed[1:]) / subnets - compute) / 3)


class _SupernetModule(_NullModule):
    """The engine's view of a module training ``supernet`` on ``x`` with ``optimizer``: a sum as the loss."""

    def __init__(self, supernet: Supernet, optimizer: OptimizerFactory) -> None:
        self.supernet = supernet
        self.optimizer = optimizer(list(supernet.parameters()))

    def compute_loss(self, output: Any, batch: Any) -> Tensor:
        return sum((t.float().sum() for t in tensors_in(output) if t.is_floating_point()), torch.zeros(()))


def _scale_to_engine(spec: SpaceSpec, net: Supernet, x: Any, optimizer: OptimizerFactory,
                     clock: Callable[[], float], seconds: float, window: int = 8) -> None:
    """Scale ``spec``'s compute costs (in place) by the one-stage engine's time over the profile's for the
    same sampled subnets: the engine's per-action overhead and the run's costs stay as measured."""
    from lightning_naspipe.planning.planner import simulate  # the planner imports this module's package

    module, engine = _SupernetModule(net, optimizer), Engine([range(len(net))])
    engine.train_window(module, [x] * 4, 10**6)  # warm-up, on subnets of their own
    first, start = 0, clock()
    while first < 16 or clock() - start < seconds:
        engine.train_window(module, [x] * window, first)
        first += window
    measured_ms = 1000 * (clock() - start)
    bare = dataclasses.replace(spec, step_overhead_ms=0.0, subnet_overhead_ms=0.0)
    no_compute = dataclasses.replace(bare, update_ms=0.0, blocks=[
        BlockSpec(b.label, [dataclasses.replace(c, forward_ms=0.0, backward_ms=0.0, input_backward_ms=None,
                                                weight_backward_ms=None) for c in b.candidates])
        for b in spec.blocks])
    fixed_ms = simulate(no_compute, 1, window, subnets=first).makespan_ms
    compute_ms = simulate(bare, 1, window, subnets=first).makespan_ms - fixed_ms
    scale = (measured_ms - fixed_ms) / compute_ms if compute_ms > 0 and measured_ms > fixed_ms else 1.0
    def scaled(c: CandidateSpec) -> CandidateSpec:
        passes = c.deferred_ms
        return dataclasses.replace(c, forward_ms=c.forward_ms * scale, backward_ms=c.backward_ms * scale,
                                   input_backward_ms=None if passes is None else passes[0] * scale,
                                   weight_backward_ms=None if passes is None else passes[1] * scale)
    for block in spec.blocks:
        block.candidates = [scaled(c) for c in block.candidates]
    spec.update_ms *= scale
