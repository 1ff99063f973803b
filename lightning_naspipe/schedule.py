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

Time is discrete: an action occupies ticks ``[start, finish)`` and dependents may
start at ``finish`` (plus ``latency`` across stages). A stage runs one action at a
time, picking U, then B, then F, each by lowest ``(subnet, chunk)``. Example, ``C=2``:
subnets 0 and 2 share a parameter on stage 0, subnet 1 shares nothing. F1.0 runs
before U0 on stage 0; F2.0 must wait for U0 (``.`` is an idle tick, ``-`` would
continue a multi-tick action)::

    tick |    0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15   16
    s0   | F0.0 F0.1 F1.0 B0.0 F1.1 B0.1 U0   F2.0 B1.0 F2.1 B1.1 U1   .    B2.0 .    B2.1 U2
    s1   | .    F0.0 B0.0 F0.1 B0.1 U0   F1.0 B1.0 F1.1 B1.1 U1   F2.0 B2.0 F2.1 B2.1 U2   .
"""

import heapq
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["BACKWARD", "FORWARD", "SCHEDULES", "UPDATE", "Action", "DeadlockError", "Schedule", "ScheduleError",
           "build_schedule", "check_schedule", "replay", "scheduling_resources"]

FORWARD = "F"
BACKWARD = "B"
UPDATE = "U"
# Heap rank of each kind: lower runs first (updates unblock CSP waiters, backward frees memory).
_U, _B, _F = 0, 1, 2
_RANK = {UPDATE: _U, BACKWARD: _B, FORWARD: _F}
_KINDS = (UPDATE, BACKWARD, FORWARD)

Resources = Sequence[Sequence[AbstractSet[Hashable]]]
CostFn = Callable[[int, "Action"], int]


class ScheduleError(AssertionError):
    """A schedule breaks a NASPipe rule; the message names the rule."""


class DeadlockError(ScheduleError):
    """Replaying the per-stage orders without a global clock gets stuck."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on a stage: ``F``/``B`` of a chunk, or ``U`` of a subnet."""

    kind: str
    subnet: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _RANK:
            raise ValueError(f"Action kind must be 'F', 'B' or 'U', got {self.kind!r}")
        if self.subnet < 0 or self.chunk < 0 or (self.kind == UPDATE and self.chunk != 0):
            raise ValueError(f"invalid Action {self.kind}{self.subnet}.{self.chunk}")

    def __str__(self) -> str:
        return f"U{self.subnet}" if self.kind == UPDATE else f"{self.kind}{self.subnet}.{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage execution orders plus the simulated start/finish tick of each action."""

    stages: tuple[tuple[Action, ...], ...]
    start: Mapping[tuple[int, Action], int]
    finish: Mapping[tuple[int, Action], int]

    @property
    def makespan(self) -> int:
        """Tick at which the last action of the window finishes."""
        return max(self.finish.values(), default=0)

    def sends(self, stage: int, direction: str) -> tuple[tuple[int, int], ...]:
        """Return ``(subnet, chunk)`` of each message ``stage`` sends, in send order.

        Args:
            stage: Sending stage.
            direction: ``"forward"`` (activations to ``stage+1``, one per F) or
                ``"backward"`` (gradients to ``stage-1``, one per B).
        """
        if not 0 <= stage < len(self.stages):
            raise ValueError(f"stage {stage} out of range 0..{len(self.stages) - 1}")
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        kind, peer = (FORWARD, stage + 1) if direction == "forward" else (BACKWARD, stage - 1)
        if not 0 <= peer < len(self.stages):
            return ()
        return tuple((a.subnet, a.chunk) for a in self.stages[stage] if a.kind == kind)

    def table(self) -> str:
        """Render an ASCII timeline: one row per stage, one column per tick."""
        ticks = self.makespan
        rows = [["."] * ticks for _ in self.stages]
        for (s, a), begin in self.start.items():
            end = self.finish[(s, a)]
            rows[s][begin : end] = [str(a)] + ["-"] * (end - begin - 1)
        width = max([len(str(max(ticks - 1, 0)))] + [len(c) for row in rows for c in row])
        head = "tick | " + " ".join(str(t).rjust(width) for t in range(ticks))
        body = [f"s{s:<3} | " + " ".join(c.ljust(width) for c in row) for s, row in enumerate(rows)]
        return "\n".join(line.rstrip() for line in [head, *body])


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _validate(resources: Resources, num_chunks: int) -> tuple[tuple[frozenset[Hashable], ...], ...]:
    """Check the inputs and freeze them; raise ``ValueError``/``TypeError`` naming the problem."""
    _check_int("num_chunks", num_chunks, 1)
    if len(resources) == 0:
        raise ValueError("resources is empty: a window needs at least one subnet")
    if len(resources[0]) == 0:
        raise ValueError("resources[0] has zero stages: a pipeline needs at least one stage")
    for i, per_stage in enumerate(resources):
        if len(per_stage) != len(resources[0]):
            raise ValueError(f"ragged resources: subnet {i} has {len(per_stage)} stages, subnet 0 {len(resources[0])}")
        for s, keys in enumerate(per_stage):
            if not isinstance(keys, AbstractSet):
                raise TypeError(f"resources[{i}][{s}] must be a set of keys, got {type(keys).__name__}")
    return tuple(tuple(frozenset(keys) for keys in per_stage) for per_stage in resources)


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
                   done: AbstractSet[tuple[int, Action]] = frozenset()) -> Schedule:
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

    Returns:
        The deterministic list schedule (greedy: a stage never idles while ready).
    """
    res = _validate(resources, num_chunks)
    _check_int("latency", latency, 0)
    n, num_stages, chunks = len(res), len(res[0]), num_chunks
    last = num_stages - 1
    acts = [[[Action(k, i, c) for c in range(1 if k == UPDATE else chunks)] for i in range(n)] for k in _KINDS]
    gates = _csp_gates(res)
    waiters: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(num_stages)]  # F(i, 0) gated on U(k)
    for s, row in enumerate(gates):
        for i, k in enumerate(row):
            if k >= 0:
                waiters[s][k].append(i)
    # left[s][rank][i][c]: dependencies of that action not yet satisfied.
    left = [
        [
            [[1 + (i > 0)] for i in range(n)],
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
            return found + [(0, (s, _B, i, c + 1) if c + 1 < chunks else (s, _U, i, 0))]
        # An update feeds the next update and the forwards CSP-gated on it.
        return [(0, (s, _U, i + 1, 0))] * (i + 1 < n) + [(0, (s, _F, j, 0)) for j in waiters[s][i]]

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
    return Schedule(tuple(tuple(o) for o in orders), MappingProxyType(start), MappingProxyType(finish))


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


def _require(ok: bool, rule: str, detail: str, *args: object) -> None:
    if not ok:  # format lazily: the checks run per action and per dependency
        raise ScheduleError(f"{rule} violated: " + detail.format(*args))


def _deps(s: int, a: Action, num_stages: int, chunks: int) -> list[tuple[int, Action, str]]:
    """Non-CSP dependencies of ``a`` on stage ``s`` as ``(stage, action, rule)``."""
    i, c = a.subnet, a.chunk
    if a.kind == FORWARD:
        deps = [(s - 1, Action(FORWARD, i, c), "forward dependency")] if s > 0 else []
        return deps + ([(s, Action(FORWARD, i, c - 1), "chunk order")] if c > 0 else [])
    if a.kind == BACKWARD:
        deps = [(s, Action(FORWARD, i, c), "forward-before-backward")]
        deps += [(s + 1, Action(BACKWARD, i, c), "backward dependency")] if s < num_stages - 1 else []
        return deps + ([(s, Action(BACKWARD, i, c - 1), "chunk order")] if c > 0 else [])
    deps = [(s, Action(BACKWARD, i, k), "backward-before-update") for k in range(chunks)]
    return deps + ([(s, Action(UPDATE, i - 1), "update order")] if i > 0 else [])


def check_schedule(schedule: Schedule, resources: Resources, num_chunks: int) -> None:
    """Raise :class:`ScheduleError` (an ``AssertionError``) naming the first broken rule.

    Checked first from the per-stage orders alone (exactly-once, chunk order, forward
    before backward, update order, CSP), then against the ticks (one action at a time
    in list order, every dependency incl. cross-stage, CSP). Conflicts are recomputed
    pairwise, independently of :func:`build_schedule`.
    """
    res = _validate(resources, num_chunks)
    n, num_stages, chunks = len(res), len(res[0]), num_chunks
    got = len(schedule.stages)
    _require(got == num_stages, "stage count", "schedule has {} stages, resources {}", got, num_stages)
    expected = {Action(k, i, c) for i in range(n) for k in (FORWARD, BACKWARD) for c in range(chunks)}
    expected |= {Action(UPDATE, i) for i in range(n)}
    pairs = [[(k, i) for i in range(n) for k in range(i) if not res[k][s].isdisjoint(res[i][s])] for s in range(got)]
    for s, order in enumerate(schedule.stages):
        pos: dict[Action, int] = {}
        for p, a in enumerate(order):
            _require(a not in pos, "exactly-once", "{} appears twice on stage {}", a, s)
            pos[a] = p
        missing, extra = sorted(expected - pos.keys()), sorted(pos.keys() - expected)
        _require(not missing, "exactly-once", "stage {} misses {}", s, ", ".join(map(str, missing)))
        _require(not extra, "exactly-once", "stage {} has unexpected {}", s, ", ".join(map(str, extra)))
        for a in order:
            for s_dep, dep, rule in _deps(s, a, num_stages, chunks):
                _require(s_dep != s or pos[dep] < pos[a], rule, "stage {} runs {} before {}", s, a, dep)
        first = [min(pos[Action(FORWARD, i, c)] for c in range(chunks)) for i in range(n)]
        for k, i in pairs[s]:
            _require(pos[Action(UPDATE, k)] < first[i], "CSP", "stage {} runs F{} before conflicting U{}", s, i, k)
    start, finish = schedule.start, schedule.finish
    _require(len(start) == len(finish) == num_stages * len(expected), "timing", "start/finish have unknown keys")
    for s, order in enumerate(schedule.stages):
        free_at = 0
        for a in order:
            _require((s, a) in start and (s, a) in finish, "timing", "no ticks for {} on stage {}", a, s)
            _require(finish[(s, a)] > start[(s, a)] >= free_at, "one-action-per-tick", "{}@stage {} overlaps", a, s)
            free_at = finish[(s, a)]
            for s_dep, dep, rule in _deps(s, a, num_stages, chunks):
                ok = start[(s, a)] >= finish[(s_dep, dep)]
                _require(ok, rule, "{}@stage {} starts before {}@stage {} ends", a, s, dep, s_dep)
        first = [min(start[(s, Action(FORWARD, i, c))] for c in range(chunks)) for i in range(n)]
        for k, i in pairs[s]:
            ok = finish[(s, Action(UPDATE, k))] <= first[i]
            _require(ok, "CSP", "F{}@stage {} starts before conflicting U{} ends", i, s, k)


def _receive(inbox: deque[tuple[int, int]], early: Counter[tuple[int, int]], want: tuple[int, int]) -> bool:
    """Take ``want`` from the buffer or from the FIFO link, buffering what arrives first."""
    if early[want] > 0:
        early[want] -= 1
        return True
    while inbox:
        msg = inbox.popleft()
        if msg == want:
            return True
        early[msg] += 1
    return False


def replay(schedule: Schedule, num_stages: int) -> None:
    """Run the per-stage orders as independent processes would, with no global clock.

    Each stage walks its list; an F on ``s > 0`` (a B on ``s < S-1``) blocks until its
    activation (gradient) has been sent. Links are FIFO, sends never block, early
    messages are buffered. Raises :class:`DeadlockError` if no stage can progress
    before all finish, :class:`ScheduleError` if a sent message is never consumed.
    """
    if num_stages != len(schedule.stages):
        raise ValueError(f"num_stages={num_stages} but the schedule has {len(schedule.stages)} stages")
    # inbox[s][0]: activations from s-1; inbox[s][1]: gradients from s+1.
    inbox = [(deque[tuple[int, int]](), deque[tuple[int, int]]()) for _ in range(num_stages)]
    early = [(Counter[tuple[int, int]](), Counter[tuple[int, int]]()) for _ in range(num_stages)]
    pc = [0] * num_stages
    while any(pc[s] < len(order) for s, order in enumerate(schedule.stages)):
        progressed = False
        for s, order in enumerate(schedule.stages):
            while pc[s] < len(order):
                a = order[pc[s]]
                msg, link = (a.subnet, a.chunk), int(a.kind == BACKWARD)
                needs_msg = (a.kind == FORWARD and s > 0) or (a.kind == BACKWARD and s < num_stages - 1)
                if needs_msg and not _receive(inbox[s][link], early[s][link], msg):
                    break
                peer = s + 1 if a.kind == FORWARD else s - 1
                if a.kind != UPDATE and 0 <= peer < num_stages:
                    inbox[peer][link].append(msg)
                pc[s] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {s} at {o[pc[s]]}" for s, o in enumerate(schedule.stages) if pc[s] < len(o))
            raise DeadlockError(f"replay deadlocked: {stuck}")
    for s in range(num_stages):
        left = [*inbox[s][0], *inbox[s][1], *(+early[s][0]).elements(), *(+early[s][1]).elements()]
        _require(not left, "message matching", "stage {} never received {}", s, left)


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
