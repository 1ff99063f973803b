"""Block costs measured as training runs them: the one measurement and the one reduction of it.

Blocks are timed *as training runs them* (:func:`time_paths`): whole paths through the supernet,
path ``r`` taking candidate ``r mod n`` of every block, forward block by block and then one
backward, so inputs have the right shapes and caches are as cold as in training, where the ops
keep changing. Timing an op alone, again and again on the same input, keeps its weights and
activations in cache and undercounts the blocks with many weights (seen: a SPOS CNN's stage
shares off by 20 points).

One reduction everywhere (the stage split, the profile, the planner): a candidate costs the
median of its timed rounds (``space_spec.candidate_ms``: what a training run pays for it) and
a block costs the mean over its candidates (``space_spec.block_cost_ms``), the expected cost of a
uniformly sampled subnet's pick.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.space.boundary import cut, grad_targets, tensors_in
from lightning_naspipe.space.choice import active_architecture, choice_counts
from lightning_naspipe.space.supernet import BlockValue
from lightning_naspipe.pipeline.runtime.optim import module_parameters, restrict_param_groups
from lightning_naspipe.planning.space_spec import candidate_ms
from lightning_naspipe.pipeline.sampling.keyed import keyed_rng
from lightning_naspipe.pipeline.exactness.replicas import replay_statistics, tracks_statistics
from lightning_naspipe.pipeline.exactness.weight_grads import DeferredWeights

__all__ = ["BlockFailure", "PathTimes", "holds_state", "time_paths"]


class BlockFailure(RuntimeError):
    """A block failed while being timed; ``index`` is the block (``None``: in the backward pass)."""

    def __init__(self, index: int | None, error: BaseException) -> None:
        self.index = index
        where = f"block {index}" if index is not None else "the backward pass"
        super().__init__(f"{where} failed ({type(error).__name__}: {error})")


@dataclass
class PathTimes:
    """Seconds measured by :func:`time_paths`, warm-up excluded.

    Attributes:
        forward: per block, per candidate, one value per timed path that took it.
        backward: the same for the backward.
        update: the optimizer step per op that holds state, one value per timed path (none without an
            optimizer); a path whose ops trained nothing counts 0.
        variants: aligned with ``forward``: which candidates the choices nested in the block took on
            that path (``()`` when it has none); empty: all ``()``.
        input_backward: aligned with ``forward`` (empty unless timed): the block's backward as a stage that
            defers its weight gradients runs it, the input-gradient pass (:mod:`...weight_grads`).
        weight_backward: the same, the weight-gradient pass after it.
        replay: aligned with ``forward`` (empty unless timed): replaying the BatchNorm running-statistics updates
            of the block's forward, as a later data-parallel replica does in every update (:mod:`...replicas`).
    """

    forward: list[list[list[float]]]
    backward: list[list[list[float]]]
    update: list[float] = field(default_factory=list)
    variants: list[list[list[tuple[int, ...]]]] = field(default_factory=list)
    input_backward: list[list[list[float]]] = field(default_factory=list)
    weight_backward: list[list[list[float]]] = field(default_factory=list)
    replay: list[list[list[float]]] = field(default_factory=list)

    def cost_ms(self, block: int, candidate: int) -> tuple[float, float]:
        """Forward and backward milliseconds of ``candidate`` of ``block``: per variant of its nested
        choices the :func:`~.space_spec.candidate_ms` of its rounds, then the mean over the variants
        (a sampled cell's expected cost; the median of a mix of cells would be one cell's)."""
        return self._reduce(self.forward, block, candidate), self._reduce(self.backward, block, candidate)

    def deferred_ms(self, block: int, candidate: int) -> tuple[float, float] | None:
        """Input- and weight-gradient pass milliseconds, reduced as :meth:`cost_ms`; ``None`` if not timed."""
        if not self.input_backward:
            return None
        return (self._reduce(self.input_backward, block, candidate),
                self._reduce(self.weight_backward, block, candidate))

    def replay_ms(self, block: int, candidate: int) -> float:
        """Milliseconds of the BatchNorm statistics replay, reduced as :meth:`cost_ms`; 0 if not timed."""
        return self._reduce(self.replay, block, candidate) if self.replay else 0.0

    @classmethod
    def merged(cls, parts: Sequence[PathTimes]) -> PathTimes:
        """The times of ``parts`` (:func:`time_paths`' shares of one set of paths, e.g. one per process) as one
        measurement: per block and candidate the parts' values in order, so every process that merges the same
        parts in the same order reduces them to the same costs."""
        def joined(series: Callable[[PathTimes], list[list[list[Any]]]]) -> list[list[list[Any]]]:
            return [[[v for part in parts for v in series(part)[i][k]] for k in range(len(block))]
                    for i, block in enumerate(series(parts[0]))]

        def variants(part: PathTimes) -> list[list[list[tuple[int, ...]]]]:
            return part.variants or [[[()] * len(k) for k in block] for block in part.forward]

        return cls(joined(lambda p: p.forward), joined(lambda p: p.backward), [v for p in parts for v in p.update],
                   joined(variants), joined(lambda p: p.input_backward), joined(lambda p: p.weight_backward),
                   joined(lambda p: p.replay))

    def _reduce(self, series: list[list[list[float]]], block: int, candidate: int) -> float:
        seconds = series[block][candidate]
        picks = self.variants[block][candidate] if self.variants else [()] * len(seconds)
        kinds = sorted(set(picks))
        return sum(candidate_ms([t for t, p in zip(seconds, picks) if p == kind]) for kind in kinds) / len(kinds)


def time_paths(ops: list[list[nn.Module]], example_input: BlockValue, repeats: int,
               clock: Callable[[], float] = time.perf_counter,
               optimizer: torch.optim.Optimizer | None = None, deferred: bool = False,
               share: tuple[int, int] = (0, 1), replay: bool = False) -> PathTimes:
    """Train paths through ``ops`` (per block, its candidates) and time every block of each.

    One warm-up round, then ``repeats`` rounds of as many paths as the most candidates of any choice
    (nested ones included: path ``r`` also takes candidate ``r mod n`` of every nested choice). A block's
    backward ends when the gradient of its input is computed (a hook on it); the first blocks,
    whose inputs need no gradient, end when the backward returns. With an ``optimizer`` (over the
    ops' parameters), each path ends with a step restricted to the path's parameters, as the
    engine updates a subnet. With ``deferred``, each path then runs once more, cut at every block
    boundary as training runs it, with each block's weight gradients deferred (:mod:`...weight_grads`),
    timing the two passes (:attr:`PathTimes.input_backward`, :attr:`PathTimes.weight_backward`).
    ``share=(index, count)``: run only the paths ``p`` (warm-up and timed rounds alike) with ``p % count == index``,
    so ``count`` processes each time a share of the paths at once and :meth:`PathTimes.merged` joins their parts
    (a candidate timed by no share gets no values). With ``replay``, each block's BatchNorm running-statistics
    updates are replayed after the backward and timed (:attr:`PathTimes.replay`). Modifies the ops (gradients,
    buffers, optimizer state): time copies.

    Raises:
        BlockFailure: a block's forward or the backward raised.
    """
    for candidates in ops:
        for op in candidates:
            op.train()
    nested = nested_choice_counts(ops)
    nested_labels = [[sorted(nested_choice_counts([[op]])) for op in c] for c in ops]
    paths = max([len(c) for c in ops] + list(nested.values()))
    def per_candidate() -> list[list[list[float]]]:
        return [[[] for _ in c] for c in ops]

    times = PathTimes(per_candidate(), per_candidate(), variants=[[[] for _ in c] for c in ops],
                      input_backward=per_candidate() if deferred else [],
                      weight_backward=per_candidate() if deferred else [],
                      replay=per_candidate() if replay else [])
    index, count = share
    if not 0 <= index < count:
        raise ValueError(f"share must be (index, count) with 0 <= index < count, got {share}")
    for run in range((repeats + 1) * paths):  # the first round warms up kernels and optimizer state
        if run % paths % count != index:
            continue
        picks = [run % len(c) for c in ops]
        # Nested choices cycle through their candidates too, so a cell costs what a sampled cell does.
        inside = {label: run % count for label, count in nested.items()}
        path = [c[k] for c, k in zip(ops, picks)]
        forward, backward, update, replays = _time_path(path, example_input, optimizer, run, clock, inside, replay)
        passes = _time_deferred(path, example_input, run, clock, inside) if deferred else None
        if run >= paths:
            for i, k in enumerate(picks):
                times.forward[i][k].append(forward[i])
                times.backward[i][k].append(backward[i])
                times.variants[i][k].append(tuple(inside[label] for label in nested_labels[i][k]))
                if replay:
                    times.replay[i][k].append(replays[i])
                if passes is not None:
                    times.input_backward[i][k].append(passes[i][0])
                    times.weight_backward[i][k].append(passes[i][1])
            times.update += update
    return times


def holds_state(op: nn.Module) -> bool:
    """Whether ``op`` has parameters or buffers: a candidate the scheduler treats as a resource."""
    return any(True for _ in op.parameters()) or any(True for _ in op.buffers())


def nested_choice_counts(ops: list[list[nn.Module]]) -> dict[str, int]:
    """Candidates per label of the choices nested inside ``ops`` (a cell's edges, say)."""
    return {label: count for candidates in ops for op in candidates for m in op.modules()
            for label, count in choice_counts(m)}


def _time_path(path: list[nn.Module], x: Any, optimizer: torch.optim.Optimizer | None, run: int,
               clock: Callable[[], float],
               nested: Mapping[str, int],
               replay: bool = False) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seconds of each block's forward and backward along ``path``, of its update per stateful op, and with
    ``replay`` of each block's BatchNorm statistics replay (else zeros)."""
    n = len(path)
    forward, done = [0.0] * n, [0.0] * (n + 1)
    with _statistics_inputs(path if replay else []) as inputs:
        for i, op in enumerate(path):
            for t in tensors_in(x):
                if t.requires_grad:
                    stamp = lambda grad, i=i: done.__setitem__(i, max(done[i], clock()))  # noqa: E731
                    t.register_hook(stamp)  # type: ignore[no-untyped-call]
            t0 = clock()
            try:
                with keyed_rng(torch.device("cpu"), 0, run, i, 0), active_architecture(nested):
                    x = op(x)
            except Exception as error:
                raise BlockFailure(i, error) from error
            forward[i] = clock() - t0
    outs = [o for o in tensors_in(x) if o.requires_grad]
    done[n] = clock()
    try:
        if outs:
            sum(o.float().sum() for o in outs).backward()  # type: ignore[union-attr]
    except Exception as error:
        raise BlockFailure(None, error) from error
    end = clock()
    done = [t or end for t in done]
    backward = [max(done[i] - done[i + 1], 0.0) for i in range(n)]
    # The step over what the path trained, as the engine steps a subnet's resources, per op that holds
    # state: the planner charges a subnet update_ms per such pick, whatever its nested choices trained.
    # (A cell's cost swings with them: 0.3 ms with skip edges, 2.7 ms with convolutions, on nb201.)
    params = [p for p in module_parameters(path) if p.grad is not None]
    owners = sum(holds_state(op) for op in path)
    update = []
    if optimizer is not None and owners:
        t0 = clock()
        if params:
            with restrict_param_groups(optimizer, params):
                optimizer.step()
        update = [(clock() - t0) / owners]
    for p in params:
        p.grad = None  # each path's backward starts from no gradients, as the engine's
    return forward, backward, update, [_replayed(inputs.get(i, []), clock) for i in range(n)]


@contextlib.contextmanager
def _statistics_inputs(path: Sequence[nn.Module]) -> Iterator[dict[int, list[tuple[nn.Module, Tensor]]]]:
    """Per block of ``path``, what its layers that update BatchNorm statistics receive in the forward, in order."""
    inputs: dict[int, list[tuple[nn.Module, Tensor]]] = {}

    def keep(i: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        return lambda layer, args: inputs.setdefault(i, []).append((layer, args[0].detach()))

    hooks = [m.register_forward_pre_hook(keep(i)) for i, op in enumerate(path) for m in op.modules()
             if tracks_statistics(m)]
    try:
        yield inputs
    finally:
        for hook in hooks:
            hook.remove()


def _replayed(inputs: Sequence[tuple[nn.Module, Tensor]], clock: Callable[[], float]) -> float:
    """Seconds to replay the statistics updates of ``inputs`` (layer, batch), in order."""
    t0 = clock()
    for layer, batch in inputs:
        replay_statistics(layer, batch)
    return clock() - t0 if inputs else 0.0


def _time_deferred(path: list[nn.Module], x: Any, run: int, clock: Callable[[], float],
                   nested: Mapping[str, int]) -> list[tuple[float, float]]:
    """Per block of ``path``, seconds of its input-gradient pass and of its weight-gradient pass, blocks
    cut at every boundary; the first block's input, as given, may need no gradient (one pass then)."""
    saved = []
    for i, op in enumerate(path):
        if i > 0:
            x = cut(x)
        with keyed_rng(torch.device("cpu"), 0, run, i, 0), active_architecture(nested):
            y = op(x)
        saved.append((x, y))
        x = y
    grads: tuple[Tensor | None, ...] = tuple(torch.ones_like(t) for t in grad_targets(x))
    passes: list[tuple[float, float]] = [(0.0, 0.0)] * len(path)
    pending = []
    for i in reversed(range(len(path))):
        inputs, outputs = saved[i]
        deferred, t0 = DeferredWeights(), clock()
        grads = deferred.backward(outputs, grads, inputs, list(path[i].parameters()))
        pending.append((i, deferred, clock() - t0))
    for i, deferred, seconds in pending:
        t0 = clock()
        deferred.run()
        passes[i] = (seconds, clock() - t0)
    for op in path:
        for p in op.parameters():
            p.grad = None
    return passes
