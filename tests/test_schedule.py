"""Tests for the CSP pipeline scheduler (lightning_naspipe.schedule.schedules)."""

from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.schedule.rules import check_schedule, replay

Res = list[list[frozenset[Hashable]]]
_RANK = {UPDATE: 0, BACKWARD: 1, FORWARD: 2}


def F(i: int, c: int = 0) -> Action:
    return Action(FORWARD, i, c)


def B(i: int, c: int = 0) -> Action:
    return Action(BACKWARD, i, c)


def U(i: int) -> Action:
    return Action(UPDATE, i, 0)


def uniform(n: int, stages: int, keys: AbstractSet[Hashable] = frozenset()) -> Res:
    return [[frozenset(keys) for _ in range(stages)] for _ in range(n)]


def conflicts(res: Sequence[Sequence[AbstractSet[Hashable]]], s: int) -> list[tuple[int, int]]:
    return [(k, i) for i in range(len(res)) for k in range(i) if set(res[k][s]) & set(res[i][s])]


def reference(res: Res, chunks: int, cost: Callable[[int, Action], int] | None = None,
              norms: bool = False) -> dict[tuple[int, Action], int]:
    """Literal tick-by-tick reading of the rules: rescan every pending action every tick."""
    n, stages = len(res), len(res[0])
    cost = cost or (lambda s, a: 1)
    fin: dict[tuple[int, Action], int] = {}
    start: dict[tuple[int, Action], int] = {}
    todo = [
        {F(i, c) for i in range(n) for c in range(chunks)} | {B(i, c) for i in range(n) for c in range(chunks)}
        | {U(i) for i in range(n)}
        for _ in range(stages)
    ]
    busy = [0] * stages

    def done(s: int, a: Action, t: int) -> bool:
        return (s, a) in fin and fin[(s, a)] <= t

    def ready(s: int, a: Action, t: int) -> bool:
        i, c = a.subnet, a.chunk
        if a.kind == FORWARD:
            return (
                (s == 0 or done(s - 1, F(i, c), t))
                and (c == 0 or done(s, F(i, c - 1), t))
                and all(done(s, U(k), t) for k in range(i) if res[k][s] & res[i][s])
            )
        if a.kind == BACKWARD:
            return (
                done(s, F(i, c), t)
                and (s == stages - 1 or done(s + 1, B(i, c), t))
                and (c == 0 or done(s, B(i, c - 1), t))
            )
        everywhere = range(stages) if norms else (s,)  # the norm exchange: every stage's backwards and updates
        return all(done(r, B(i, k), t) for r in everywhere for k in range(chunks)) and (
            i == 0 or all(done(r, U(i - 1), t) for r in everywhere))

    t = 0
    while any(todo):
        for s in range(stages):
            if busy[s] > t:
                continue
            cands = [a for a in todo[s] if ready(s, a, t)]
            if cands:
                a = min(cands, key=lambda x: (_RANK[x.kind], x.subnet, x.chunk))
                todo[s].remove(a)
                start[(s, a)] = t
                fin[(s, a)] = busy[s] = t + cost(s, a)
        t += 1
        assert t < 100_000
    return start


# ----------------------------------------------------------------------------- unit tests


def test_single_stage_single_chunk_is_strictly_sequential() -> None:
    sched = build_schedule(uniform(4, 1, {"w"}), 1)
    assert [str(a) for a in sched.stages[0]] == ["F0.0", "B0.0", "U0", "F1.0", "B1.0", "U1", "F2.0", "B2.0", "U2",
                                                 "F3.0", "B3.0", "U3"]
    # Even with no conflicts, a single stage with one chunk cannot reorder anything.
    assert build_schedule(uniform(4, 1), 1).stages == sched.stages
    assert sched.makespan == 12


def test_disjoint_resources_overlap_subnets() -> None:
    n = 6
    sched = build_schedule(uniform(n, 2), 1)
    sequential = build_schedule(uniform(n, 2, {"shared"}), 1)
    check_schedule(sched, uniform(n, 2), 1)
    assert sched.makespan < sequential.makespan
    # Subnet 1 starts its forward on stage 0 before subnet 0 updates there.
    assert sched.start[(0, F(1))] < sched.finish[(0, U(0))]


def test_shared_resource_serializes_that_stage_only() -> None:
    res: Res = [[frozenset({"fixed"}), frozenset({("op", i)})] for i in range(5)]
    sched = build_schedule(res, 2)
    check_schedule(sched, res, 2)
    order0 = sched.stages[0]
    for k in range(4):
        assert order0.index(U(k)) < order0.index(F(k + 1, 0))
        assert sched.finish[(0, U(k))] <= sched.start[(0, F(k + 1, 0))]
    # Micro-batches still pipeline: stage 1 forwards chunk 0 while stage 0 forwards chunk 1.
    for k in range(5):
        assert sched.start[(1, F(k, 0))] == sched.start[(0, F(k, 1))]
    # Without the shared block, stage 0 lets later subnets overtake earlier updates.
    free = build_schedule([[frozenset(), r[1]] for r in res], 2)
    assert any(free.stages[0].index(F(k + 1, 0)) < free.stages[0].index(U(k)) for k in range(4))
    assert free.makespan < sched.makespan


def test_chunks_pipeline_across_stages() -> None:
    sched = build_schedule(uniform(1, 2, {"w"}), 2)
    check_schedule(sched, uniform(1, 2, {"w"}), 2)
    # Stage 1 works on chunk 0 while stage 0 forwards chunk 1.
    assert sched.start[(1, F(0, 0))] == sched.start[(0, F(0, 1))] == 1
    assert sched.makespan < 2 * (2 * 2 + 1)  # better than running the stages back to back
    for s in range(2):
        bs = [a for a in sched.stages[s] if a.kind == BACKWARD]
        assert bs == [B(0, 0), B(0, 1)]


def test_norm_exchange_makes_every_update_wait_for_every_stage() -> None:
    """Global-norm clipping: stage 1 finishes subnet 0's backward first, but its U0 waits for stage 0's
    B0 (the last backward of subnet 0 anywhere); the trainable head then holds back F1 on stage 1."""
    res: Res = [[frozenset({("cand", i)}), frozenset({"head"})] for i in range(3)]
    plain, clipped = build_schedule(res, 1), build_schedule(res, 1, norms=True)
    for sched in (plain, clipped):
        check_schedule(sched, res, 1)
        replay(sched, 2)
    assert plain.start[(1, U(0))] < plain.finish[(0, B(0))]
    for i in range(3):
        assert clipped.start[(1, U(i))] >= clipped.finish[(0, B(i))]
        assert i == 0 or clipped.start[(0, U(i))] >= clipped.finish[(1, U(i - 1))]
    assert clipped.makespan > plain.makespan, "the exchange costs pipelining through the shared head"
    assert build_schedule(res, 1, norms=True).norms and not plain.norms
    assert build_schedule(uniform(3, 1), 1, norms=True).stages == build_schedule(uniform(3, 1), 1).stages


def test_module_docstring_table_is_current() -> None:
    import lightning_naspipe.schedule.schedules as mod

    res: Res = [[frozenset({"a"}), frozenset({"c"})], [frozenset({"b"}), frozenset({"d"})],
                [frozenset({"a"}), frozenset({"e"})]]
    lines = [ln.strip() for ln in (mod.__doc__ or "").splitlines()]
    documented = [ln for ln in lines if ln.startswith(("tick |", "s0 ", "s1 "))]
    assert documented == [ln.strip() for ln in build_schedule(res, 2).table().splitlines()]


def test_costs_and_latency() -> None:
    res = uniform(3, 3)
    def cost(s: int, a: Action) -> int:
        return {FORWARD: 1, BACKWARD: 2, UPDATE: 1}[a.kind]
    sched = build_schedule(res, 2, cost)
    check_schedule(sched, res, 2)
    replay(sched, 3)
    assert all(sched.finish[(s, a)] - sched.start[(s, a)] == cost(s, a) for s, o in enumerate(sched.stages) for a in o)
    slow = build_schedule(res, 2, cost, latency=3)
    check_schedule(slow, res, 2)
    assert slow.start[(1, F(0, 0))] >= slow.finish[(0, F(0, 0))] + 3
    assert slow.makespan > sched.makespan
    with pytest.raises(ValueError, match="cost"):
        build_schedule(res, 1, lambda s, a: 0)
    with pytest.raises(ValueError, match="latency"):
        build_schedule(res, 1, latency=-1)


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="num_chunks"):
        build_schedule(uniform(2, 2), 0)
    with pytest.raises(ValueError, match="ragged"):
        build_schedule([[frozenset()], [frozenset(), frozenset()]], 1)
    with pytest.raises(ValueError, match="zero stages"):
        build_schedule([[], []], 1)
    with pytest.raises(ValueError, match="at least one subnet"):
        build_schedule([], 1)
    with pytest.raises(TypeError):
        build_schedule([["ab"]], 1)  # type: ignore[list-item]
    sched = build_schedule(uniform(2, 2), 1)
    with pytest.raises(ValueError, match="num_chunks"):
        check_schedule(sched, uniform(2, 2), 0)
    with pytest.raises(ValueError, match="num_stages"):
        replay(sched, 3)


def test_large_window_is_valid() -> None:
    # Timing of this size belongs in benchmarks/, not in an assertion here.
    import random

    rng = random.Random(0)
    res: Res = [[frozenset(rng.sample(range(6), rng.randint(0, 2))) for _ in range(8)] for _ in range(64)]
    sched = build_schedule(res, 4)
    check_schedule(sched, res, 4)
    replay(sched, 8)


# ----------------------------------------------------------------------------- property tests


@st.composite
def windows(draw: st.DrawFn, max_n: int = 24, max_stages: int = 6, max_chunks: int = 3) -> tuple[Res, int]:
    stages = draw(st.integers(1, max_stages))
    n = draw(st.integers(1, max_n))
    chunks = draw(st.integers(1, max_chunks))
    res: Res = [[frozenset() for _ in range(stages)] for _ in range(n)]
    for s in range(stages):
        mode = draw(st.sampled_from(["pool", "pool", "shared", "empty"]))
        pool = draw(st.integers(1, 4))
        for i in range(n):
            keys: set[Hashable] = set(draw(st.frozensets(st.integers(0, pool - 1), max_size=2)))
            if mode == "empty":
                keys.clear()
            if mode == "shared":
                keys.add("X")  # a trainable fixed block every subnet uses on this stage
            res[i][s] = frozenset((s, k) for k in keys)
    return res, chunks


def _costs(seed: int) -> Callable[[int, Action], int]:
    def cost(s: int, a: Action) -> int:
        return 1 + (seed * 7 + s * 13 + a.subnet * 5 + a.chunk * 3 + _RANK[a.kind]) % 3
    return cost


def _assert_valid(sched: Schedule, res: Res, chunks: int) -> None:
    n, stages = len(res), len(res[0])
    check_schedule(sched, res, chunks)
    replay(sched, stages)
    for s, order in enumerate(sched.stages):
        assert sorted(order) == sorted([F(i, c) for i in range(n) for c in range(chunks)]
                                       + [B(i, c) for i in range(n) for c in range(chunks)] + [U(i) for i in range(n)])
        for k, i in conflicts(res, s):
            assert order.index(U(k)) < order.index(F(i, 0))


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(), st.booleans(), st.integers(0, 2))
def test_property_schedules_are_valid(window: tuple[Res, int], weighted: bool, latency: int) -> None:
    res, chunks = window
    sched = build_schedule(res, chunks, _costs(len(res)) if weighted else None, latency=latency)
    _assert_valid(sched, res, chunks)
    assert build_schedule(res, chunks, _costs(len(res)) if weighted else None, latency=latency) == sched


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows())
def test_property_never_forwards_past_unfinished_conflict(window: tuple[Res, int]) -> None:
    """Brute force from ticks: at every F(i, c) start, each earlier conflicting U(k) has finished."""
    res, chunks = window
    sched = build_schedule(res, chunks)
    for s in range(len(res[0])):
        for i in range(len(res)):
            for c in range(chunks):
                t = sched.start[(s, F(i, c))]
                for k in range(i):
                    if res[k][s] & res[i][s]:
                        assert sched.finish[(s, U(k))] <= t, (s, k, i, c)
    # More stages or chunks never lose pipelining against one stage, one chunk: sanity on makespan bounds.
    n, stages = len(res), len(res[0])
    assert sched.makespan <= stages * n * (2 * chunks + 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(max_n=7, max_stages=4), st.booleans())
def test_property_matches_literal_reference(window: tuple[Res, int], weighted: bool) -> None:
    """The event-driven simulator equals a tick-by-tick rescan of the written rules."""
    res, chunks = window
    cost = _costs(len(res[0])) if weighted else None
    sched = build_schedule(res, chunks, cost)
    assert dict(sched.start) == reference(res, chunks, cost)


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(), st.booleans(), st.integers(0, 2))
def test_property_schedules_with_norm_exchange_are_valid_and_never_deadlock(
        window: tuple[Res, int], weighted: bool, latency: int) -> None:
    """Global-norm clipping: every update waits for all stages' backwards of its subnet; the orders
    still keep every rule, and stage processes exchanging norms inside their updates cannot hang."""
    res, chunks = window
    sched = build_schedule(res, chunks, _costs(len(res)) if weighted else None, latency=latency, norms=True)
    _assert_valid(sched, res, chunks)
    stages = len(res[0])
    for i in range(len(res)):
        ready = max(sched.finish[(r, B(i, c))] for r in range(stages) for c in range(chunks))
        assert all(sched.start[(s, U(i))] >= ready for s in range(stages))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(max_n=7, max_stages=4), st.booleans())
def test_property_norm_exchange_matches_literal_reference(window: tuple[Res, int], weighted: bool) -> None:
    res, chunks = window
    cost = _costs(len(res[0])) if weighted else None
    assert dict(build_schedule(res, chunks, cost, norms=True).start) == reference(res, chunks, cost, norms=True)
