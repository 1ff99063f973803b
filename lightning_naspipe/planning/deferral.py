"""How the planner models deferred weight gradients (:mod:`lightning_naspipe.pipeline.exactness.weight_grads`).

A stage that defers runs a backward's input-gradient passes, sends the gradient, then runs the weight
passes: its B costs both passes, and its message leaves after the first. Which stages defer in which
windows follows the engine's :class:`~lightning_naspipe.pipeline.exactness.weight_grads.DeferralChooser` on the modelled
times: eligible windows are those the engine deems so
(:func:`~lightning_naspipe.pipeline.exactness.weight_grads.serialised`,
``chunks=1``), and the trials' medians are those of every eligible subnet's time to send.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from lightning_naspipe.planning.space_spec import CandidateSpec, SpaceSpec
from lightning_naspipe.pipeline.exactness.weight_grads import DeferralChooser, serialised

__all__ = ["deferring", "passes"]


def deferring(spec: SpaceSpec, ranges: Sequence[range], architectures: Sequence[Mapping[str, int]],
              resources: Sequence[Sequence[AbstractSet[Hashable]]], window: int, chunks: int,
              forced: bool | None) -> list[list[bool]]:
    """Per subnet and stage, whether that stage defers its weight gradients in the subnet's window
    (``resources[i][s]``: subnet ``i``'s on stage ``s``; ``forced`` as ``NASPipeStrategy(defer_weight_grads)``)."""
    stages, n = len(ranges), len(architectures)
    eligible = [[False] * stages for _ in range(n)]
    for first in range(0, n, window):
        size = min(window, n - first)
        for s in range(1, stages):
            flag = chunks == 1 and serialised(resources[first:first + size], size, s)
            for i in range(first, first + size):
                eligible[i][s] = flag
    decided = [False] * stages
    for s in range(1, stages):
        chooser = DeferralChooser(trials=1, forced=forced)
        one_pass: list[float] = []
        deferred: list[float] = []
        for i, arch in enumerate(architectures):
            ops = _picks(spec, arch, ranges[s])
            split = passes(ops, s == stages - 1)
            if eligible[i][s] and split is not None:
                one_pass.append(sum(o.backward_ms for o in ops))
                deferred.append(split[0])
        chooser.record(False, one_pass)
        chooser.record(True, deferred)
        decided[s] = forced if forced is not None else bool(chooser.decided)
    return [[s > 0 and decided[s] and (forced is not None or eligible[i][s]) for s in range(stages)]
            for i in range(n)]


def passes(ops: Sequence[CandidateSpec], last: bool) -> tuple[float, float] | None:
    """A stage's deferred backward over ``ops``: milliseconds until its gradient's send and after it
    (``None`` if a pick's passes are not measured). On the last stage the loss block takes one pass
    first (Lightning's ``manual_backward``)."""
    split = [o.deferred_ms for o in (ops[:-1] if last else ops)]
    measured = [p for p in split if p is not None]
    if len(measured) < len(split):
        return None
    return sum(p[0] for p in measured) + (ops[-1].backward_ms if last else 0.0), sum(p[1] for p in measured)


def _picks(spec: SpaceSpec, arch: Mapping[str, int], blocks: range) -> list[CandidateSpec]:
    return [spec.blocks[b].candidates[spec.blocks[b].pick(arch)] for b in blocks]
