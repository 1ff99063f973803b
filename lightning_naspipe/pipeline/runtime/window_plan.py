"""Planning one window, before any of it runs: each training step's resources per stage and the CSP schedule
(pure: no processes, no tensors touched). Every stage process computes the same plan and runs its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule, with_ties
from lightning_naspipe.schedule.lookahead import plan_step
from lightning_naspipe.pipeline.offload.residency import memory_conflicts
from lightning_naspipe.schedule.schedules import build_schedule, scheduling_resources
from lightning_naspipe.pipeline.exactness.ties import ties_of
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.space.supernet import Resource, Supernet

__all__ = ["WindowPlan", "plan_window"]


@dataclass
class WindowPlan:
    """What every stage process computes alike for one window, before running any of it.

    Attributes:
        window: the subnets, their architectures and micro-batches; with lookahead, the next
            window's subnets follow this window's (see :mod:`.lookahead`).
        resources: ``resources[k][s]``: the resources subnet ``k`` uses on stage ``s``, and a resource tied across
            stages on its owner for every subnet using it anywhere (:func:`.actions.with_ties`).
        schedule: the per-stage action orders.
        schedule_mode: one of :data:`SCHEDULES`.
        size: how many of ``window``'s subnets are this window's own.
        carried: the next window's forwards this window runs (its ``done``, see :func:`.plan_step`).
    """

    window: Window
    resources: list[list[frozenset[Resource]]]
    schedule: Schedule
    schedule_mode: str
    size: int
    carried: frozenset[tuple[int, Action]] = frozenset()

    def actions(self, stage: int) -> list[Action]:
        """Stage ``stage``'s actions, in the order it runs them."""
        actions = list(self.schedule.stages[stage])
        if self.schedule_mode == "async":
            # Updates after the window's last backward: with conflicts ignored, an update in the middle
            # would change weights that other in-flight subnets saved for their backward. Updates send
            # nothing, so moving them keeps every link's message order.
            actions = [a for a in actions if a.kind != UPDATE] + [a for a in actions if a.kind == UPDATE]
        return actions

    def run_schedule(self) -> Schedule:
        """The schedule with each stage's actions in the order it runs them (the order messages are sent)."""
        if self.schedule_mode != "async":
            return self.schedule
        return replace(self.schedule, stages=tuple(tuple(self.actions(s)) for s in range(len(self.schedule.stages))))


_EXCHANGE_TICKS = {FORWARD: 2, BACKWARD: 4, UPDATE: 1}


def _exchange_cost(stage: int, action: Action) -> int:
    """Ticks the schedule gives an action when updates exchange norms. The stages' updates of a subnet run
    together, so a stage that reaches ``U(i)`` early waits in it for the others' backwards; with every action
    one tick, a later stage would put ``U(i)`` before its next backward and wait there for stage 0's longer
    backward of ``i``. A backward takes about twice a forward, an update less (20-25% more subnets/s on
    independent subnets than with one tick each, in a model of 2 stages; ``docs/design.md``)."""
    return _EXCHANGE_TICKS[action.kind]


def plan_window(supernet: Supernet, window: Window, stage_blocks: Sequence[range], schedule_mode: str, chunks: int,
                memory_budget: tuple[int, Sequence[dict[Any, int]]] | None = None, upcoming: Window | None = None,
                done: frozenset[tuple[int, Action]] = frozenset(), norms: bool = False,
                chained_last: bool = False) -> WindowPlan:
    """Plan ``window``: each subnet's resources per stage and the schedule (pure: no processes, no
    tensors touched). ``memory_budget`` as for :class:`Engine`. With ``upcoming`` (the next window) or
    ``done`` (this window's forwards run ahead), plan with lookahead (``"csp"`` only, no budget).
    ``norms``: updates exchange gradient norms (global-norm clipping, see :mod:`.grad_norm`).
    ``chained_last``: on the last stage every step waits for the update of the one before, whatever they share
    (the replicas' teacher relay, :mod:`.distillation`, needs a step's forwards there without an update between)."""
    size = len(window.architectures)
    if upcoming is not None or done:
        if schedule_mode != "csp" or memory_budget is not None:
            raise ValueError("lookahead plans schedule='csp' without a memory budget only")
        if upcoming is not None:
            window = Window(window.first_index, window.architectures + upcoming.architectures,
                            window.pieces + upcoming.pieces, steps=window.steps + upcoming.steps)
    # A step's resources: those of every subnet it trains (they all read the weights the step's update writes).
    resources = [[frozenset().union(*(supernet.resources(blocks, arch) for arch in step)) for blocks in stage_blocks]
                 for step in window.steps]
    ties = ties_of(supernet, stage_blocks)
    if ties is not None:
        resources = with_ties(resources, ties.homes)
    if upcoming is not None or done:
        def may_run_early(subnet: int, stage: int) -> bool:  # a forward may change buffers (BatchNorm)
            return not any(supernet.resource_state(r).buffers for r in resources[subnet][stage])

        step = plan_step(_chained_last(resources, chained_last), size, chunks, done, may_run_early, norms,
                         _exchange_cost if norms else None)
        return WindowPlan(window, resources, step.schedule, schedule_mode, size, step.carried)
    planned = scheduling_resources(schedule_mode, resources)
    if memory_budget is not None:
        budget, sizes = memory_budget
        by_stage = [memory_conflicts([r[s] for r in planned], sizes[s], budget) for s in range(len(sizes))]
        planned = [[by_stage[s][k] for s in range(len(sizes))] for k in range(len(planned))]
    schedule = build_schedule(_chained_last(planned, chained_last), chunks, _exchange_cost if norms else None,
                              norms=norms)
    return WindowPlan(window, resources, schedule, schedule_mode, size)


_CHAIN = "the last stage's chain of steps"


def _chained_last(resources: Sequence[Sequence[frozenset[Any]]], chained: bool) -> Sequence[Sequence[frozenset[Any]]]:
    """``resources``; ``chained``: with one key every step holds on the last stage (for the schedule only: updates
    step the real ones)."""
    return [[*row[:-1], row[-1] | {_CHAIN}] for row in resources] if chained else resources

