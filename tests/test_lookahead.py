"""Tests for lookahead across windows (lightning_naspipe.schedule.lookahead): steps planned one after another
form one valid CSP schedule of the whole run, and the next window's forwards fill the drain."""

from collections.abc import Hashable, Sequence
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_naspipe.schedule.actions import CostFn
from lightning_naspipe.pipeline.runtime.window_plan import _exchange_cost
from lightning_naspipe.schedule.lookahead import StepPlan, plan_step
from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, Action, Schedule
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.schedule.rules import check_schedule, replay

Res = list[list[frozenset[Hashable]]]


def roll(windows: Sequence[Res], chunks: int, buffers: frozenset[tuple[int, int]] = frozenset(),
         norms: bool = False, cost: CostFn | None = None) -> tuple[Schedule, Res, list[StepPlan]]:
    """Plan every window with the next one as lookahead, as the engine does, and join the steps into
    one schedule over the whole run (each step's ticks after the one before). ``buffers``: global
    ``(subnet, stage)`` whose resources hold buffers; ``norms``: updates exchange gradient norms (the engine
    then plans with ``cost``, see engine._exchange_cost)."""
    stages = len(windows[0][0])
    orders: list[list[Action]] = [[] for _ in range(stages)]
    start: dict[tuple[int, Action], int] = {}
    finish: dict[tuple[int, Action], int] = {}
    plans, done, first, offset = [], frozenset[tuple[int, Action]](), 0, 0
    for w, window in enumerate(windows):
        upcoming = windows[w + 1] if w + 1 < len(windows) else []
        size = len(window)
        plan = plan_step(window + upcoming, size, chunks, done,
                         lambda i, s, first=first: (first + i, s) not in buffers, norms, cost)
        plans.append(plan)
        for s, order in enumerate(plan.schedule.stages):
            for a in order:
                key = (s, Action(a.kind, first + a.subnet, a.chunk))
                orders[s].append(key[1])
                start[key] = offset + plan.schedule.start[(s, a)]
                finish[key] = offset + plan.schedule.finish[(s, a)]
        offset += plan.schedule.makespan
        done, first = plan.carried, first + size
    whole = Schedule(tuple(map(tuple, orders)), MappingProxyType(start), MappingProxyType(finish), norms)
    return whole, [r for window in windows for r in window], plans


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[Res], int, frozenset[tuple[int, int]]]:
    stages = draw(st.integers(1, 4))
    chunks = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    shared = draw(st.lists(st.booleans(), min_size=stages, max_size=stages))  # a stem/head every subnet uses
    windows = []
    for size in sizes:
        window = []
        for _ in range(size):
            keys = [draw(st.frozensets(st.integers(0, 3), max_size=2)) for _ in range(stages)]
            window.append([frozenset((s, k) for k in ks) | ({(s, "X")} if shared[s] else set())
                           for s, ks in enumerate(keys)])
        windows.append(window)
    total = sum(sizes)
    buffers = draw(st.frozensets(st.tuples(st.integers(0, total - 1), st.integers(0, stages - 1)), max_size=4))
    return windows, chunks, buffers


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs(), st.booleans())
def test_property_rolled_steps_are_one_valid_schedule(run: tuple[list[Res], int, frozenset[tuple[int, int]]],
                                                      norms: bool) -> None:
    """Also with the norm exchange of global-norm clipping: the next window's forwards that run in
    this one's drain never wait on a stage that waits in an update for them."""
    windows, chunks, buffers = run
    whole, res, plans = roll(windows, chunks, buffers, norms, _exchange_cost if norms else None)
    check_schedule(whole, res, chunks)  # every action once, every dependency and CSP, over the whole run
    replay(whole, len(res[0]))  # stage processes walking their rows cannot hang
    last = len(res[0]) - 1
    first = 0
    for plan, window in zip(plans, windows):
        for s, action in plan.carried:
            assert action.kind == FORWARD and s < last, "only forwards, never on the last stage"
            assert (first + len(window) + action.subnet, s) not in buffers, "not where buffers would change"
        first += len(window)
    assert not plans[-1].carried, "nothing runs ahead of the run's last window"


def test_next_window_forwards_fill_the_drain() -> None:
    """Independent subnets on 2 stages, windows of 4: stage 0 forwards the next window's first subnets
    while this window's last ones finish on stage 1, and the run gets shorter."""
    windows = [[[frozenset({(s, w * 4 + i)}) for s in range(2)] for i in range(4)] for w in range(3)]
    whole, _, plans = roll(windows, 1)
    assert {a for _, a in plans[0].carried} == {Action(FORWARD, 0), Action(FORWARD, 1)}
    assert all(s == 0 for s, _ in plans[0].carried)
    drained = sum(build_schedule(window, 1).makespan for window in windows)
    assert whole.makespan < drained
    # Stage 0's first step runs the next window's first forwards (4, 5) between this one's last backwards.
    assert [str(a) for a in plans[0].schedule.stages[0][-6:]] == ["F4.0", "B2.0", "U2", "F5.0", "B3.0", "U3"]
    assert [str(a) for a in plans[1].schedule.stages[0][:2]] == ["F2.0", "F3.0"], "the carried ones are not rerun"


def test_no_lookahead_through_a_shared_stem_or_buffers() -> None:
    """A trainable stem every subnet uses gates the next window on this one's last update; buffers
    (BatchNorm statistics) keep a forward in its own window."""
    stem = [[frozenset({(0, "stem"), (0, i)}), frozenset({(1, i)})] for i in range(8)]
    assert not plan_step(stem, 4, 1).carried
    free = [[frozenset({(0, i)}), frozenset({(1, i)})] for i in range(8)]
    assert plan_step(free, 4, 1).carried
    assert not plan_step(free, 4, 1, may_run_early=lambda i, s: False).carried


def test_done_actions_are_not_rescheduled_and_must_be_closed() -> None:
    res = [[frozenset({(s, i)}) for s in range(2)] for i in range(3)]
    done = frozenset({(0, Action(FORWARD, 0))})
    sched = build_schedule(res, 1, done=done)
    assert Action(FORWARD, 0) not in sched.stages[0] and Action(FORWARD, 0) in sched.stages[1]
    with pytest.raises(ValueError, match="closed under the schedule's dependencies"):
        build_schedule(res, 1, done=frozenset({(1, Action(FORWARD, 0))}))  # its stage-0 half never ran
    with pytest.raises(ValueError, match="closed under"):
        build_schedule(res, 1, done=frozenset({(0, Action(BACKWARD, 0))}))
    with pytest.raises(ValueError, match="window_size"):
        plan_step(res, 0, 1)


def test_a_forward_gated_on_a_next_window_update_stays_in_its_window() -> None:
    """4 stages: next-window subnets 2 and 3 share a parameter on stage 2. Subnet 2 updates there
    before this window's end, so subnet 3's forward would fit the drain, but the update belongs to the
    next step: the forward must wait for it (found by random search against a plan without this rule)."""
    def res(*keys: set[int]) -> list[frozenset[Hashable]]:
        return [frozenset((s, k) for k in ks) for s, ks in enumerate(keys)]
    windows = [[res({0}, {0, 1}, {1}, {0}), res({1}, {1}, {1}, {1})],
               [res(set(), set(), {0}, set()), res({2}, {2}, {0, 2}, set())]]
    whole, flat, plans = roll(windows, 1)
    check_schedule(whole, flat, 1)
    assert (2, Action(FORWARD, 1)) not in plans[0].carried
    assert (1, Action(FORWARD, 1)) in plans[0].carried, "its upstream half still runs ahead"
