"""Tests for the plain-data pipeline types (lightning_naspipe.schedule.actions): Action, Schedule."""

import pytest

from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, NORMS, UPDATE, Action
from lightning_naspipe.schedule.schedules import build_schedule
from test_schedule import B, F, Res, U


def test_action_str_and_validation() -> None:
    assert (str(F(3, 1)), str(B(3, 1)), str(U(3))) == ("F3.1", "B3.1", "U3")
    assert F(0) < U(0) and B(5) < F(0)  # order=True: sortable
    with pytest.raises(ValueError):
        Action("X", 0, 0)
    with pytest.raises(ValueError):
        Action(UPDATE, 0, 1)


def test_sends_follow_stage_order() -> None:
    res: Res = [[frozenset({"a"}), frozenset()], [frozenset({"b"}), frozenset()], [frozenset({"a"}), frozenset()]]
    sched = build_schedule(res, 2)
    for s in range(2):
        fwd = tuple((a.subnet, a.chunk) for a in sched.stages[s] if a.kind == FORWARD)
        bwd = tuple((a.subnet, a.chunk) for a in sched.stages[s] if a.kind == BACKWARD)
        assert sched.sends(s, "forward") == (fwd if s == 0 else ())
        assert sched.sends(s, "backward") == (bwd if s == 1 else ())
    assert len(sched.sends(0, "forward")) == 6
    with pytest.raises(ValueError):
        sched.sends(2, "forward")
    with pytest.raises(ValueError):
        sched.sends(0, "sideways")


def test_sends_with_norms_carry_one_norm_message_per_update_both_ways() -> None:
    res: Res = [[frozenset({"a"}) for _ in range(3)] for _ in range(2)]
    sched = build_schedule(res, 1, norms=True)
    for s in range(3):
        for direction, kind in (("forward", FORWARD), ("backward", BACKWARD)):
            has_peer = 0 <= s + (1 if direction == "forward" else -1) < 3
            expected = tuple((a.subnet, NORMS if a.kind == UPDATE else a.chunk)
                             for a in sched.stages[s] if a.kind in (kind, UPDATE))
            assert sched.sends(s, direction) == (expected if has_peer else ())
    assert (0, NORMS) in sched.sends(1, "backward") and (1, NORMS) in sched.sends(1, "forward")


def test_table_renders_every_action() -> None:
    res: Res = [[frozenset({"a"}), frozenset({"c"})], [frozenset({"b"}), frozenset({"c"})]]
    sched = build_schedule(res, 2, cost=lambda s, a: 2 if a.kind == BACKWARD else 1)
    text = sched.table()
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("tick") and lines[1].startswith("s0") and lines[2].startswith("s1")
    for s, order in enumerate(sched.stages):
        for a in order:
            assert str(a) in lines[s + 1]
    assert "-" in lines[1]  # 2-tick backward continuation
