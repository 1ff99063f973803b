"""A short profile of a supernet's blocks: the :class:`~.space_spec.SpaceSpec` the planner predicts from.

Every candidate of every block is timed forward and backward (CPU wall time by default, after a
warm-up round) while training paths through the supernet that cycle through the candidates, so
inputs have the right shapes and caches are as cold as in training (:mod:`.block_cost`, reduced
with :func:`~.space_spec.candidate_ms`, as the stage split is). The optimizer step is timed as the
engine runs it, and the engine's own per-action overhead on a stand-in of 1x1 ops. It runs on a copy
of the supernet inside a forked RNG: the user's weights, gradients, buffers and the global RNG are
left untouched. The costs that depend on the run rather than the space (Lightning's loop, the
transport, shared cores) are passed in as ``**overheads``; ``benchmarks/overhead_harness.py``
measures them. Several processes can profile one space at once, each a share of the paths
(:func:`profile_share`), and every process joins the shares into the same :class:`SpaceSpec` (:func:`spec_of`).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.space.boundary import map_tensors, tensors_in
from lightning_naspipe.pipeline.exactness.replicas import tracks_statistics
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.planning.block_cost import PathTimes, holds_state, time_paths
from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.space.choice import ChoiceBlock, candidates_of
from lightning_naspipe.space.supernet import BlockValue, Supernet

__all__ = ["EngineRun", "ProfileShare", "engine_run", "profile_share", "profile_supernet", "scale_to_engine", "spec_of"]

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def _default_optimizer(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def profile_supernet(supernet: Supernet, sample_input: BlockValue, repeats: int = 3,
                     optimizer: OptimizerFactory = _default_optimizer, clock: Callable[[], float] = time.perf_counter,
                     engine_seconds: float = 2.0, deferred: bool = True, **overheads: float) -> SpaceSpec:
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
        deferred: also time each candidate's backward as two passes, input then weight gradients
            (``input_backward_ms``/``weight_backward_ms``); ``False`` halves the time the profile takes and leaves
            them ``None``, which the planner models as stages that never defer (as the engine does at ``chunks > 1``
            unless ``defer_weight_grads=True``).
        **overheads: other :class:`SpaceSpec` fields (``message_ms``, ``step_overhead_ms``, ...), which
            depend on the run, not the space; ``action_overhead_ms`` defaults to the engine's, measured.

    Returns:
        The space's :class:`SpaceSpec`, blocks and labels as in ``supernet``.
    """
    with torch.random.fork_rng(devices=[]):
        share = profile_share(supernet, sample_input, repeats, optimizer, clock, deferred,
                              engine_overhead="action_overhead_ms" not in overheads)
        spec = spec_of(supernet, [share], **overheads)
        if engine_seconds > 0:
            run = engine_run(copy.deepcopy(supernet), sample_input, optimizer, clock, engine_seconds)
            scale_to_engine(spec, supernet.labels, [run])
        return spec


@dataclass
class ProfileShare:
    """One process's part of a profile (:func:`profile_share`): its paths' times and, from one process, the engine's
    per-action overhead (``None`` from the others); :func:`spec_of` joins the parts of every process."""

    times: PathTimes
    action_overhead_ms: float | None = None
    engine: EngineRun | None = None


def profile_share(supernet: Supernet, sample_input: BlockValue, repeats: int = 1,
                  optimizer: OptimizerFactory = _default_optimizer, clock: Callable[[], float] = time.perf_counter,
                  deferred: bool = True, share: tuple[int, int] = (0, 1), engine_overhead: bool = True,
                  device: torch.device | None = None, engine_seconds: float = 0.0) -> ProfileShare:
    """This process's share of :func:`profile_supernet`'s timings: the paths :func:`~.block_cost.time_paths` deals
    to ``share=(index, count)``, with ``engine_overhead`` the engine's per-action overhead, and with
    ``engine_seconds`` > 0 a short :func:`engine_run` of subnets of this share's own (at least 4), which
    :func:`spec_of` scales the joined compute to; so ``count`` processes profile a space at once, each a share, and
    :func:`spec_of` joins their parts (the same :class:`SpaceSpec` wherever the same parts are joined in the same
    order). Times a copy of ``supernet`` on ``device`` (default: where it is) inside a forked RNG.

    Raises:
        BlockFailure: a block cannot run on ``sample_input`` (or on the previous block's output).
    """
    with torch.random.fork_rng(devices=[]):
        net = copy.deepcopy(supernet)
        if device is not None:
            net, sample_input = net.to(device), map_tensors(lambda t: t.to(device), sample_input)
        times = time_paths([candidates_of(b) for b in net.blocks], sample_input, repeats, clock,
                           optimizer(list(net.parameters())), deferred=deferred, share=share, replay=True)
        run = (engine_run(net, sample_input, optimizer, clock, engine_seconds, first=share[0] * 10**4, min_subnets=4,
                          window=4, warmup=2) if engine_seconds > 0 else None)
        return ProfileShare(times, _engine_overhead(supernet, clock) if engine_overhead else None, run)


def spec_of(supernet: Supernet, shares: Sequence[ProfileShare], **overheads: Any) -> SpaceSpec:
    """The :class:`SpaceSpec` of ``supernet`` from every share of its profile (:func:`profile_share`), in order, its
    compute scaled to the shares' engine runs where they made any; ``overheads`` as :func:`profile_supernet`'s (a
    measured ``action_overhead_ms`` is the default)."""
    measured = [s.action_overhead_ms for s in shares if s.action_overhead_ms is not None]
    if measured and "action_overhead_ms" not in overheads:
        overheads["action_overhead_ms"] = measured[0]
    blocks, update_ms = _blocks_of(supernet, PathTimes.merged([s.times for s in shares]))
    spec = SpaceSpec(blocks, update_ms=update_ms, **overheads)
    runs = [s.engine for s in shares if s.engine is not None]
    if runs:
        scale_to_engine(spec, supernet.labels, runs)
    return spec


def _blocks_of(net: Supernet, times: PathTimes) -> tuple[list[BlockSpec], float]:
    """Per-candidate costs, and the update's per resource, from the times of paths through every candidate."""
    ops = [candidates_of(b) for b in net.blocks]
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
    trained = [p for p in op.parameters() if p.requires_grad]
    tracked = [b for m in op.modules() if tracks_statistics(m) for b in m.buffers(recurse=False)]
    return CandidateSpec(forward_ms, backward_ms, holds_state(op), any(True for _ in op.buffers()), input_ms, weight_ms,
                         sum(p.numel() * p.element_size() for p in trained), len(trained), len(tracked),
                         times.replay_ms(block, k))


def _engine_overhead(net: Supernet, clock: Callable[[], float], window: int = 4, subnets: int = 32) -> float:
    """Milliseconds per action the one-stage engine spends beyond the profiled compute (bookkeeping,
    sampling, scheduling, the loss call): a stand-in supernet with the same blocks, labels and candidate
    counts but 1x1 linear ops, trained by the engine, minus its own profile."""
    def tiny() -> nn.Module:
        return nn.Linear(1, 1)
    stand_in = Supernet(*[ChoiceBlock([tiny() for _ in b.candidates], b.label) if isinstance(b, ChoiceBlock)
                          else tiny() for b in net.blocks])
    module, engine = _NullModule(stand_in), Engine([range(len(stand_in))])
    share = profile_share(stand_in, torch.zeros(1, 1), 2, clock=clock, deferred=False, engine_overhead=False)
    blocks, update_ms = _blocks_of(stand_in, share.times)
    compute = sum(b.cost_ms for b in blocks)
    compute += update_ms * len(blocks)
    elapsed = []
    for _ in range(3):  # a warm-up round, then the median of two
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


@dataclass(frozen=True)
class EngineRun:
    """The one-stage engine training subnets ``first .. first + count - 1`` (``uniform_architecture(labels, 0, i)``)
    on one sample input, ``window`` at a time, in ``ms`` (:func:`engine_run`): what :func:`spec_of` scales a
    profile's compute to."""

    first: int
    count: int
    window: int
    ms: float


def engine_run(net: Supernet, x: Any, optimizer: OptimizerFactory, clock: Callable[[], float], seconds: float,
               first: int = 0, min_subnets: int = 16, window: int = 8, warmup: int = 4) -> EngineRun:
    """Train sampled subnets of ``net`` (changed: pass a copy) with the one-stage engine for about ``seconds`` (at
    least ``min_subnets``, whole windows) after ``warmup`` subnets of their own, and time them."""
    module, engine = _SupernetModule(net, optimizer), Engine([range(len(net))])
    engine.train_window(module, [x] * warmup, first + 10**6)
    index, start = first, clock()
    while index - first < min_subnets or clock() - start < seconds:
        engine.train_window(module, [x] * window, index)
        index += window
    return EngineRun(first, index - first, window, 1000 * (clock() - start))


def scale_to_engine(spec: SpaceSpec, labels: dict[str, int], runs: Sequence[EngineRun]) -> None:
    """Scale ``spec``'s compute costs (in place) by the engine's time over the profile's for the same subnets, summed
    over ``runs``: timed one at a time, blocks run faster than in training, which cycles through every candidate's
    weights; the engine's per-action overhead and the run's costs stay as measured."""
    from lightning_naspipe.planning.planner import simulate  # the planner imports this module's package

    bare = dataclasses.replace(spec, step_overhead_ms=0.0, subnet_overhead_ms=0.0)
    no_compute = dataclasses.replace(bare, update_ms=0.0, blocks=[
        BlockSpec(b.label, [dataclasses.replace(c, forward_ms=0.0, backward_ms=0.0, input_backward_ms=None,
                                                weight_backward_ms=None) for c in b.candidates])
        for b in spec.blocks])
    measured = fixed = compute = 0.0
    for run in runs:
        architectures = [uniform_architecture(labels, 0, i) for i in range(run.first, run.first + run.count)]
        run_fixed = simulate(no_compute, 1, run.window, architectures=architectures).makespan_ms
        compute += simulate(bare, 1, run.window, architectures=architectures).makespan_ms - run_fixed
        measured, fixed = measured + run.ms, fixed + run_fixed
    scale = (measured - fixed) / compute if compute > 0 and measured > fixed else 1.0
    spec.blocks = spec.compute_scaled(lambda ms: ms * scale).blocks
    spec.update_ms *= scale
