"""The rule checks of lightning_naspipe.schedule.rules can fail: each names the broken rule."""

from dataclasses import replace
from types import MappingProxyType

import pytest

from lightning_naspipe.schedule.actions import FORWARD, Action, DeadlockError, Schedule, ScheduleError
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.schedule.rules import check_schedule, replay
from test_schedule import B, F, Res, U, uniform


def _with_order(sched: Schedule, stage: int, order: list[Action]) -> Schedule:
    stages = list(sched.stages)
    stages[stage] = tuple(order)
    return replace(sched, stages=tuple(stages))


def _base() -> tuple[Schedule, Res]:
    res: Res = [[frozenset({"a"}), frozenset({"x"})], [frozenset({"b"}), frozenset({"y"})],
                [frozenset({"a"}), frozenset({"z"})]]
    sched = build_schedule(res, 2)
    check_schedule(sched, res, 2)
    return sched, res


def test_check_catches_csp_violation_in_order() -> None:
    sched, res = _base()
    order = [a for a in sched.stages[0] if a.subnet != 2 or a.kind != FORWARD]
    at = order.index(U(0))
    order[at:at] = [F(2, 0), F(2, 1)]  # subnet 2 forwards before conflicting subnet 0 updates
    with pytest.raises(ScheduleError, match="CSP"):
        check_schedule(_with_order(sched, 0, order), res, 2)


def test_check_catches_csp_violation_in_ticks() -> None:
    sched, res = _base()
    start = dict(sched.start)
    finish = dict(sched.finish)
    # Stretch U0 on stage 0 to end after F2.0 begins; keep the order untouched.
    finish[(0, U(0))] = start[(0, F(2, 0))] + 1
    bad = replace(sched, start=MappingProxyType(start), finish=MappingProxyType(finish))
    with pytest.raises(AssertionError, match="CSP|one-action-per-tick"):
        check_schedule(bad, res, 2)


def test_check_catches_swapped_conflicting_forwards() -> None:
    res: Res = [[frozenset({"a"})], [frozenset({"a"})]]
    sched = build_schedule(res, 1)
    order = list(sched.stages[0])
    i, j = order.index(F(0)), order.index(F(1))
    order[i], order[j] = order[j], order[i]
    with pytest.raises(ScheduleError):
        check_schedule(_with_order(sched, 0, order), res, 1)


def test_check_catches_chunk_reorder_and_drop_and_duplicate() -> None:
    sched, res = _base()
    order = list(sched.stages[0])
    i, j = order.index(B(1, 0)), order.index(B(1, 1))
    assert order.index(F(1, 1)) < i  # so the swap breaks only the chunk order
    order[i], order[j] = order[j], order[i]
    with pytest.raises(ScheduleError, match="chunk order"):
        check_schedule(_with_order(sched, 0, order), res, 2)
    dropped = [a for a in sched.stages[0] if a != B(0, 1)]
    with pytest.raises(ScheduleError, match="exactly-once"):
        check_schedule(_with_order(sched, 0, dropped), res, 2)
    with pytest.raises(ScheduleError, match="exactly-once"):
        check_schedule(_with_order(sched, 0, [*sched.stages[0], U(2)]), res, 2)
    swapped_updates = [U(1) if a == U(0) else U(0) if a == U(1) else a for a in sched.stages[0]]
    with pytest.raises(ScheduleError, match="update order|backward-before-update"):
        check_schedule(_with_order(sched, 0, swapped_updates), res, 2)


def test_check_catches_cross_stage_timing() -> None:
    sched, res = _base()
    start = dict(sched.start)
    start[(1, F(0, 0))] = 0  # before stage 0 has produced the activation
    with pytest.raises(ScheduleError, match="forward dependency"):
        check_schedule(replace(sched, start=MappingProxyType(start)), res, 2)


def test_replay_detects_deadlock_and_unmatched_messages() -> None:
    res = uniform(1, 2, {"w"})
    sched = build_schedule(res, 2)
    # Stage 0 waits for gradient B0.0 before sending F0.1; stage 1 waits for F0.1 before sending B0.0.
    stage0 = [F(0, 0), B(0, 0), F(0, 1), B(0, 1), U(0)]
    stage1 = [F(0, 0), F(0, 1), B(0, 0), B(0, 1), U(0)]
    with pytest.raises(DeadlockError, match="stage 0 at B0.0"):
        replay(_with_order(_with_order(sched, 0, stage0), 1, stage1), 2)
    # Out-of-order arrivals are buffered, not a deadlock.
    replay(_with_order(sched, 1, [F(0, 1), F(0, 0), B(0, 0), B(0, 1), U(0)]), 2)
    # A forward on stage 0 whose activation stage 1 never consumes.
    with pytest.raises(ScheduleError, match="never received"):
        replay(_with_order(sched, 1, [F(0, 0), B(0, 0), B(0, 1), U(0)]), 2)


def test_check_catches_an_update_before_another_stages_backward_with_norms() -> None:
    res = uniform(2, 2)
    sched = build_schedule(res, 1, norms=True)
    check_schedule(sched, res, 1)
    plain = replace(build_schedule(res, 1), norms=True)  # orders and ticks made without the exchange
    with pytest.raises(ScheduleError, match="norm exchange"):
        check_schedule(plain, res, 1)


def test_replay_finds_a_norm_exchange_deadlock() -> None:
    """Stage 1 exchanges norms in U0 before sending B1's gradient; stage 0 waits for that gradient before
    its own U0, so it never answers: fine without the exchange, a deadlock with it."""
    stages = ((F(0), F(1), B(1), B(0), U(0), U(1)), (F(0), B(0), U(0), F(1), B(1), U(1)))
    replay(Schedule(stages, {}, {}), 2)
    with pytest.raises(DeadlockError, match="stage 1 at U0"):
        replay(Schedule(stages, {}, {}, norms=True), 2)
    replay(Schedule(((F(0), B(0), U(0)),), {}, {}, norms=True), 1)  # one stage: no message to exchange
