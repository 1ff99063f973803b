"""Lookahead across windows: the next window's forwards fill this window's drain.

At a window's end the early stages idle while its last subnets finish downstream (the drain), and
at the next window's start the late stages idle until its first subnets arrive (the refill).
Architectures are known ahead (subnet ``i`` is a function of the seed and ``i``), so the next
window's forwards can run in that idle time, as the NASPipe artifact's sliding lookahead does.

What runs early is limited so that nothing between two windows can tell it happened:

* forwards only, and never on the last stage: no loss is computed early (``compute_loss`` may log
  or read the trainer), and no gradient, weight or optimizer state changes;
* only where the subnet's resources on that stage hold no buffers: a forward in training mode
  may update them (BatchNorm's running statistics), and a checkpoint would then hold them;
* CSP as always: a forward waits for the update of every earlier subnet it conflicts with, so a
  next-window forward waiting on a next-window update does not run early.

So at every window's end the weights, buffers and gradients are those of sequential training,
and checkpoints, validation and stops see exactly those; the forwards run early are dropped if
the next window never comes. One step (window ``w``, the next window's architectures known)::

    joint = build_schedule(w + (w+1), done=w's forwards run in the step before)
    cut   = the tick at which w's last action ends in joint
    step  = w's remaining actions, and the allowed forwards of w+1 that start before the cut
            (each with its dependencies), in joint's order
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType

from lightning_naspipe.schedule.actions import CostFn
from lightning_naspipe.schedule.actions import FORWARD, Action, Schedule
from lightning_naspipe.schedule.schedules import build_schedule

__all__ = ["StepPlan", "plan_step"]

Done = frozenset[tuple[int, Action]]


@dataclass(frozen=True)
class StepPlan:
    """What one step runs.

    Attributes:
        schedule: per-stage orders of this step, subnets numbered over the window and then the next one.
        carried: the next window's forwards this step runs, as ``(stage, action)`` numbered from the
            next window's first subnet: the ``done`` of the next step.
    """

    schedule: Schedule
    carried: Done


def plan_step(resources: Sequence[Sequence[AbstractSet[Hashable]]], window_size: int, chunks: int,
              done: AbstractSet[tuple[int, Action]] = frozenset(),
              may_run_early: Callable[[int, int], bool] = lambda subnet, stage: True, norms: bool = False,
              cost: CostFn | None = None) -> StepPlan:
    """Plan one step: this window's actions and the next window's forwards that fit its drain.

    Args:
        resources: ``resources[i][s]`` as for :func:`.schedule.build_schedule`: this window's
            ``window_size`` subnets, then the next window's (none: no lookahead).
        window_size: how many of ``resources`` are this window's.
        chunks: micro-batches per subnet.
        done: this window's actions that ran in the step before (its ``carried``).
        may_run_early: ``(subnet, stage)``: whether that next-window subnet's forward may run on that
            stage before its window (false where its resources there hold buffers).
        norms: updates exchange gradient norms (see :func:`.schedule.build_schedule`).
        cost: the actions' durations in ticks, as for :func:`.schedule.build_schedule`.
    """
    if not 0 < window_size <= len(resources):
        raise ValueError(f"window_size must be in 1..{len(resources)}, got {window_size}")
    joint = build_schedule(resources, chunks, cost, done=done, norms=norms)
    last = len(joint.stages) - 1
    cut = max(end for (_, action), end in joint.finish.items() if action.subnet < window_size)
    early: set[tuple[int, Action]] = set()
    for s in range(last):  # stage order: a forward's upstream half is decided first
        for action in joint.stages[s]:
            i, c = action.subnet, action.chunk
            if (action.kind != FORWARD or i < window_size or joint.start[(s, action)] >= cut
                    or not may_run_early(i, s)):
                continue
            upstream = s == 0 or (s - 1, action) in early
            previous_chunk = c == 0 or (s, Action(FORWARD, i, c - 1)) in early
            # Its CSP gate must update in this step: a conflicting next-window subnet updates only later.
            gated = c == 0 and any(not resources[j][s].isdisjoint(resources[i][s]) for j in range(window_size, i))
            if upstream and previous_chunk and not gated:
                early.add((s, action))

    def runs(s: int, action: Action) -> bool:
        return action.subnet < window_size or (s, action) in early

    stages = tuple(tuple(a for a in order if runs(s, a)) for s, order in enumerate(joint.stages))
    start = {key: tick for key, tick in joint.start.items() if runs(*key)}
    finish = {key: tick for key, tick in joint.finish.items() if runs(*key)}
    carried = frozenset((s, Action(FORWARD, a.subnet - window_size, a.chunk)) for s, a in early)
    return StepPlan(Schedule(stages, MappingProxyType(start), MappingProxyType(finish), norms), carried)
