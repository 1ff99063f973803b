"""Resources tied across stages in the pure-Python scheduler: ``with_ties`` puts a tied key on its owner stage
for every subnet that uses it anywhere, and the schedule then keeps the tied-value rule (a forward reading the
key on any stage runs after the owner's update of the last earlier subnet using it, and the value reaches it
with the activations) with no message of its own: ``check_schedule`` checks it on the ticks, ``replay`` carries
the values along the links with no clock, over random windows, lookahead steps and the norm exchange."""

from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_naspipe.schedule.actions import Ties, with_ties
from lightning_naspipe.schedule.actions import ScheduleError
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.schedule.rules import check_schedule, replay
from test_lookahead import roll
from test_schedule import B, F, Res, U, _costs

TIED = "E"  # a GPT's embedding, tied with its output head


def _gpt(n: int, stages: int) -> tuple[Res, Ties]:
    """Every subnet reads the tied weight on the first stage (embedding) and the last (head); choices between."""
    res: Res = [[frozenset({(s, i % 2)}) for s in range(stages)] for i in range(n)]
    for per_stage in res:
        per_stage[0] |= {TIED}
        per_stage[-1] |= {TIED}
    return res, {TIED: {0}}


def test_with_ties_puts_a_tied_key_on_its_owner_for_every_user() -> None:
    res: Res = [[frozenset(), frozenset({TIED})], [frozenset({"a"}), frozenset()], [frozenset({TIED}), frozenset()]]
    assert with_ties(res, {TIED: {0}}) == [[{TIED}, {TIED}], [{"a"}, set()], [{TIED}, set()]]
    assert with_ties(res, {}) == res


def test_a_reader_on_a_later_stage_waits_for_the_owners_update() -> None:
    """Subnet 0 uses the tied weight only on the last stage, subnet 1 only on the first: the owner (stage 0)
    steps it after subnet 0's backward, so subnet 1's first forward waits for that, and subnet 2 (head only)
    gets the value subnet 1's update made, through the forward chain."""
    raw: Res = [[frozenset(), frozenset({TIED})], [frozenset({TIED}), frozenset()], [frozenset(), frozenset({TIED})]]
    res = with_ties(raw, {TIED: {0}})
    sched = build_schedule(res, 1)
    check_schedule(sched, res, 1, {TIED: {0}})
    replay(sched, 2, res, {TIED: {0}})
    assert sched.start[(0, F(1, 0))] >= sched.finish[(0, U(0))]
    assert sched.start[(1, F(2, 0))] >= sched.finish[(0, U(1))]
    # Without the owner's conflict, subnet 1 would read the weight before subnet 0's gradient is in it.
    unaware = build_schedule(raw, 1)
    with pytest.raises(ScheduleError, match="tied resource"):
        check_schedule(unaware, raw, 1, {TIED: {0}})
    with pytest.raises(ScheduleError, match="tied value"):
        replay(unaware, 2, raw, {TIED: {0}})


def test_gpt_style_ties_serialise_subnets_but_pipeline_micro_batches() -> None:
    res, ties = _gpt(4, 3)
    res = with_ties(res, ties)
    sched = build_schedule(res, 3)
    check_schedule(sched, res, 3, ties)
    replay(sched, 3, res, ties)
    for i in range(1, 4):
        assert sched.start[(2, F(i, 0))] >= sched.finish[(0, U(i - 1))]
    assert sched.start[(1, F(0, 1))] < sched.start[(2, B(0, 0))], "micro-batches still flow through the stages"


@st.composite
def tied_windows(draw: st.DrawFn, max_n: int = 16, max_stages: int = 5) -> tuple[Res, int, Ties]:
    """Random windows whose subnets also use 1-2 tied keys, each owned by one stage (some by two) and read by
    later stages: always (a GPT's embedding and head) or by some subnets only (tied candidates)."""
    stages = draw(st.integers(2, max_stages))
    n = draw(st.integers(1, max_n))
    chunks = draw(st.integers(1, 3))
    res: Res = [[frozenset((s, k) for k in draw(st.frozensets(st.integers(0, 2), max_size=2))) for s in range(stages)]
                for _ in range(n)]
    ties: dict[Hashable, set[int]] = {}
    for t in range(draw(st.integers(1, 2))):
        owner = draw(st.integers(0, stages - 2))
        holders = draw(st.lists(st.integers(owner, stages - 1), min_size=1, max_size=3, unique=True))
        if max(holders) == owner:
            holders.append(stages - 1)
        owners = {owner} | ({draw(st.integers(owner, stages - 1))} if draw(st.booleans()) else set())
        always = draw(st.booleans())
        for i in range(n):
            for h in holders:
                if always or draw(st.booleans()):
                    res[i][h] |= {("T", t)}
        ties[("T", t)] = owners
    return with_ties(res, ties), chunks, ties


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tied_windows(), st.booleans(), st.integers(0, 2), st.booleans())
def test_property_tied_values_are_fresh_and_replay_never_deadlocks(window: tuple[Res, int, Ties], weighted: bool,
                                                                    latency: int, norms: bool) -> None:
    res, chunks, ties = window
    sched = build_schedule(res, chunks, _costs(len(res)) if weighted else None, latency=latency, norms=norms)
    check_schedule(sched, res, chunks, ties)
    replay(sched, len(res[0]), res, ties)


@st.composite
def tied_runs(draw: st.DrawFn) -> tuple[list[Res], int, Ties]:
    res, chunks, ties = draw(tied_windows(max_n=20, max_stages=4))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(res) - 1)), max_size=4)) - {len(res)})
    bounds = [0, *cuts, len(res)]
    return [res[a:b] for a, b in zip(bounds, bounds[1:]) if b > a], chunks, ties


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tied_runs(), st.booleans())
def test_property_lookahead_keeps_tied_values_fresh(run: tuple[list[Res], int, Ties], norms: bool) -> None:
    """The next window's forwards that run in this one's drain never read a tied weight that an update of
    the next window has yet to change: the owner's CSP gate keeps them in their own window."""
    windows, chunks, ties = run
    whole, res, _ = roll(windows, chunks, norms=norms)
    check_schedule(whole, res, chunks, ties)
    replay(whole, len(res[0]), res, ties)
