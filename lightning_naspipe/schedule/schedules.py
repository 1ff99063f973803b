"""Causal-synchronous-parallel (CSP) pipeline schedule for one window of subnets.

A window holds subnets ``0..n-1`` in training order; the reference semantics are
strictly sequential (subnet 0 trains and updates, then subnet 1, ...). Each subnet
spans ``S`` stages and its batch is split into ``C`` chunks. Per stage ``s`` the
actions are ``F(i, c)``, ``B(i, c)`` and ``U(i)``; the rules that keep a pipelined
run bitwise-identical to the sequential one:

* ``F(i, c)`` needs ``F(i, c)`` on ``s-1`` and ``F(i, c-1)`` on ``s``.
* CSP: ``F(i, *)`` needs ``U(k)`` on ``s`` for every ``k < i`` whose resources on
  ``s`` overlap ``i``'s, so ``i`` reads the weights sequential training would
  have produced. Independent later subnets may overtake blocked ones.
* ``B(i, c)`` needs ``F(i, c)`` on ``s``, ``B(i, c)`` on ``s+1`` and ``B(i, c-1)``
  on ``s``: gradients accumulate in the same chunk order, so float sums match.
* ``U(i)`` needs every ``B(i, *)`` and ``U(i-1)`` on ``s`` (subnet order keeps
  per-step LR schedulers exact).
* With ``norms`` (gradient clipping by a global norm, see :mod:`.grad_norm`): ``U(i)`` also
  needs every ``B(i, *)`` and ``U(i-1)`` on every stage, since every stage's update scales its
  gradients by a coefficient computed from every stage's gradients of ``i``.
* A resource tied across stages (a weight two stages hold, see :mod:`.ties`) is one resource: its
  owner stage steps it, and a subnet reading it on a later stage needs the owner's update of every
  earlier subnet using it. :func:`with_ties` puts the key on the owner for every subnet using it
  anywhere; CSP there and the forward chain (the value travels with the activation) do the rest,
  with no dependency or message of their own (``check_schedule``/``replay`` with ``ties`` check it).

Time is discrete: an action occupies ticks ``[start, finish)`` and dependents may
start at ``finish`` (plus ``latency`` across stages). A stage runs one action at a
time, picking U, then B, then F, each by lowest ``(subnet, chunk)``. Example, ``C=2``:
subnets 0 and 2 share a parameter on stage 0, subnet 1 shares nothing. F1.0 runs
before U0 on stage 0; F2.0 must wait for U0 (``.`` is an idle tick, ``-`` would
continue a multi-tick action)::

    tick |    0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15   16
    s0   | F0.0 F0.1 F1.0 B0.0 F1.1 B0.1 U0   F2.0 B1.0 F2.1 B1.1 U1   .    B2.0 .    B2.1 U2
    s1   | .    F0.0 B0.0 F0.1 B0.1 U0   F1.0 B1.0 F1.1 B1.1 U1   F2.0 B2.0 F2.1 B2.1 U2   .

The data types are in :mod:`.actions`, the independent rule checks (:func:`check_schedule`,
:func:`replay`) in :mod:`.schedule_rules`; this module re-exports both.
"""

import heapq
from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType

from lightning_naspipe.schedule.actions import (
    BACKWARD,
    FORWARD,
    UPDATE,
    Action,
    CostFn,
    Resources,
    Schedule,
    ScheduleError,
    check_int,
    validated,
)

__all__ = ["SCHEDULES", "build_schedule", "scheduling_resources"]

# Heap rank of each kind: lower runs first (updates unblock CSP waiters, backward frees memory).
_U, _B, _F = 0, 1, 2
_KINDS = (UPDATE, BACKWARD, FORWARD)


def _csp_gates(res: Sequence[Sequence[frozenset[Hashable]]]) -> list[list[int]]:
    """``gate[s][i]``: latest ``k < i`` conflicting with ``i`` on ``s``, or -1.

    Updates run in subnet order on each stage, so waiting for ``U(gate)`` implies
    every earlier conflicting update is done too: one dependency instead of O(n).
    """
    gates: list[list[int]] = [[] for _ in res[0]]
    for s, row in enumerate(gates):
        last_user: dict[Hashable, int] = {}
        for i, per_stage in enumerate(res):
            row.append(max([last_user.get(key, -1) for key in per_stage[s]], default=-1))
            last_user.update(dict.fromkeys(per_stage[s], i))
    return gates


def build_schedule(resources: Resources, num_chunks: int, cost: CostFn | None = None, *, latency: int = 0,
                   done: AbstractSet[tuple[int, Action]] = frozenset(), norms: bool = False) -> Schedule:
    """Simulate the CSP pipeline for one window and return per-stage action orders.

    Args:
        resources: ``resources[i][s]``: keys of the trainable modules/buffers subnet
            ``i`` touches on stage ``s`` (may be empty).
        num_chunks: Micro-batches per subnet, >= 1.
        cost: ``cost(stage, action)`` duration in ticks, an int >= 1. Default: 1 for
            every F, B and U.
        latency: Extra ticks before a cross-stage message (activation or gradient)
            can be used by the receiver. Default 0.
        done: ``(stage, action)`` pairs that already ran (forwards looked ahead in an earlier window,
            see :mod:`.lookahead`): they count as finished before tick 0 and are not in the result.
            Every dependency of a done action must be done too.
        norms: updates exchange gradient norms (global-norm clipping): every stage's ``U(i)`` waits for
            ``B(i, *)`` and ``U(i-1)`` on every stage, so all stages' ``U(i)`` run together.

    Returns:
        The deterministic list schedule (greedy: a stage never idles while ready).
    """
    res = validated(resources, num_chunks)
    check_int("latency", latency, 0)
    n, num_stages, chunks = len(res), len(res[0]), num_chunks
    last = num_stages - 1
    acts = [[[Action(k, i, c) for c in range(1 if k == UPDATE else chunks)] for i in range(n)] for k in _KINDS]
    gates = _csp_gates(res)
    waiters: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(num_stages)]  # F(i, 0) gated on U(k)
    for s, row in enumerate(gates):
        for i, k in enumerate(row):
            if k >= 0:
                waiters[s][k].append(i)
    # The norm exchange makes U(i) a step of all stages together: it waits for every stage to be ready
    # for it (B(i, last) on stage 0 comes after every other stage's B(i, *)). Then no stage runs, before
    # its U(i), anything that needs a message another stage sends after its own U(i): replay checks it.
    together = norms and num_stages > 1
    # left[s][rank][i][c]: dependencies of that action not yet satisfied.
    left = [
        [
            [[1 + (i > 0) + together * ((s > 0) + (i > 0) * last)] for i in range(n)],
            [[1 + (s < last) + (c > 0) for c in range(chunks)] for i in range(n)],
            [[(s > 0) + (c > 0) + (c == 0 and gates[s][i] >= 0) for c in range(chunks)] for i in range(n)],
        ]
        for s in range(num_stages)
    ]
    ready: list[list[tuple[int, int, int]]] = [[] for _ in range(num_stages)]  # heaps of (rank, subnet, chunk)
    ready[0] = [(_F, i, 0) for i in range(n) if gates[0][i] < 0]  # sorted, hence a valid heap
    buckets: dict[int, list[tuple[int, int, int, int]]] = {0: []}  # tick -> dependencies satisfied then
    times = [0]  # heap of the ticks in `buckets`

    def notify(when: int, target: tuple[int, int, int, int] | None) -> None:
        if when not in buckets:
            buckets[when] = []
            heapq.heappush(times, when)
        if target is not None:
            buckets[when].append(target)

    def dependents(s: int, rank: int, i: int, c: int) -> list[tuple[int, tuple[int, int, int, int]]]:
        """``(delay, dependent)`` of each action that waits for this one."""
        if rank == _F:  # feeds the next stage, the next chunk and its own backward
            found = [(latency, (s + 1, _F, i, c))] if s < last else []
            found += [(0, (s, _F, i, c + 1))] if c + 1 < chunks else []
            return found + [(0, (s, _B, i, c))]
        if rank == _B:  # feeds the previous stage, then the next chunk or the update
            found = [(latency, (s - 1, _B, i, c))] if s > 0 else []
            if together and s == 0 and c + 1 == chunks:
                found += [(latency, (t, _U, i, 0)) for t in range(1, num_stages)]
            return found + [(0, (s, _B, i, c + 1) if c + 1 < chunks else (s, _U, i, 0))]
        # An update feeds the next update (on every stage, with norms) and the forwards CSP-gated on it.
        found = [(0 if t == s else latency, (t, _U, i + 1, 0)) for t in (range(num_stages) if together else (s,))]
        return found * (i + 1 < n) + [(0, (s, _F, j, 0)) for j in waiters[s][i]]

    if done:
        _retire(done, ready, left, acts, dependents)
    start: dict[tuple[int, Action], int] = {}
    finish: dict[tuple[int, Action], int] = {}
    orders: list[list[Action]] = [[] for _ in range(num_stages)]
    busy_until = [0] * num_stages
    while times:
        now = heapq.heappop(times)
        for s, rank, i, c in buckets.pop(now):
            left[s][rank][i][c] -= 1
            if left[s][rank][i][c] == 0:
                heapq.heappush(ready[s], (rank, i, c))
        for s in range(num_stages):
            if busy_until[s] > now or not ready[s]:
                continue
            rank, i, c = heapq.heappop(ready[s])
            action = acts[rank][i][c]
            ticks = 1 if cost is None else cost(s, action)
            if type(ticks) is not int or ticks < 1:  # not _check_int: no f-string per action
                raise ValueError(f"cost({s}, {action}) must be an int >= 1, got {ticks!r}")
            ends = now + ticks
            start[(s, action)], finish[(s, action)] = now, ends
            orders[s].append(action)
            busy_until[s] = ends
            notify(ends, None)  # wake this stage when it ends even if no dependency lands then
            for delay, target in dependents(s, rank, i, c):
                notify(ends + delay, target)
    if len(start) + len(done) != num_stages * n * (2 * chunks + 1):  # unreachable: the graph is acyclic
        raise ScheduleError("internal: simulation ended with unscheduled actions")
    return Schedule(tuple(tuple(o) for o in orders), MappingProxyType(start), MappingProxyType(finish), norms)


def _retire(done: AbstractSet[tuple[int, Action]], ready: list[list[tuple[int, int, int]]],
            left: list[list[list[list[int]]]], acts: list[list[list[Action]]],
            dependents: Callable[[int, int, int, int], list[tuple[int, tuple[int, int, int, int]]]]) -> None:
    """Finish the ``done`` actions before tick 0: their dependents' counts drop, none of them runs."""
    pending = [(s, entry) for s, heap in enumerate(ready) for entry in heap if (s, acts[entry[0]][entry[1]][entry[2]])
               in done]
    for s, entry in pending:
        ready[s].remove(entry)
    for heap in ready:
        heapq.heapify(heap)
    retired = 0
    while pending:
        s, (rank, i, c) = pending.pop()
        retired += 1
        for _, (ts, tr, ti, tc) in dependents(s, rank, i, c):
            left[ts][tr][ti][tc] -= 1
            if left[ts][tr][ti][tc] == 0:
                if (ts, acts[tr][ti][tc]) in done:
                    pending.append((ts, (tr, ti, tc)))
                else:
                    heapq.heappush(ready[ts], (tr, ti, tc))
    if retired != len(done):
        raise ValueError(f"done holds {len(done) - retired} action(s) whose dependencies are not done, or that no "
                         "window has: done actions must be closed under the schedule's dependencies")


#: Schedules the engine can run. All but ``"async"`` keep the exactness contract.
SCHEDULES = ("csp", "one_in_flight", "gpipe", "async")
_EVERYTHING = frozenset({"the whole stage"})


def scheduling_resources(
    mode: str, resources: Sequence[Sequence[frozenset[Hashable]]]
) -> Sequence[Sequence[frozenset[Hashable]]]:
    """The resources the scheduler sees for a schedule ``mode`` (baselines are CSP with other conflicts).

    - ``"csp"``: the real ones; independent subnets overlap.
    - ``"one_in_flight"`` / ``"gpipe"``: every subnet conflicts with every other on every stage, so one
      subnet is in flight at a time (GPipe: its micro-batches still pipeline; use ``chunks > 1``).
    - ``"async"``: no conflicts at all; subnets overlap regardless of shared parameters and all
      updates wait for the window's end (stale weights within a window, gradients of shared
      parameters mixed), so results are NOT reproducible (for comparison only).
    """
    if mode == "csp":
        return resources
    if mode in ("one_in_flight", "gpipe"):
        return [[_EVERYTHING] * len(stages) for stages in resources]
    if mode == "async":
        return [[frozenset()] * len(stages) for stages in resources]
    raise ValueError(f"unknown schedule {mode!r}; choose one of {SCHEDULES}")
