"""The rules a CSP schedule must keep, checked independently of :func:`.schedule.build_schedule`.

:func:`check_schedule` recomputes conflicts pairwise and checks a schedule's orders and ticks;
:func:`replay` walks the per-stage orders as independent processes would (FIFO links, no clock)
and finds deadlocks and messages no stage receives.
"""

from collections import Counter, deque
from collections.abc import Hashable

from lightning_naspipe.schedule.actions import (
    BACKWARD,
    FORWARD,
    NORMS,
    UPDATE,
    Action,
    DeadlockError,
    Resources,
    Schedule,
    ScheduleError,
    Ties,
    validated,
)

__all__ = ["check_schedule", "replay"]


def _require(ok: bool, rule: str, detail: str, *args: object) -> None:
    if not ok:  # format lazily: the checks run per action and per dependency
        raise ScheduleError(f"{rule} violated: " + detail.format(*args))


def _deps(s: int, a: Action, num_stages: int, chunks: int, norms: bool = False) -> list[tuple[int, Action, str]]:
    """Non-CSP dependencies of ``a`` on stage ``s`` as ``(stage, action, rule)``; with ``norms``, an update's
    on every stage."""
    i, c = a.subnet, a.chunk
    if a.kind == FORWARD:
        deps = [(s - 1, Action(FORWARD, i, c), "forward dependency")] if s > 0 else []
        return deps + ([(s, Action(FORWARD, i, c - 1), "chunk order")] if c > 0 else [])
    if a.kind == BACKWARD:
        deps = [(s, Action(FORWARD, i, c), "forward-before-backward")]
        deps += [(s + 1, Action(BACKWARD, i, c), "backward dependency")] if s < num_stages - 1 else []
        return deps + ([(s, Action(BACKWARD, i, c - 1), "chunk order")] if c > 0 else [])
    deps = [(s, Action(BACKWARD, i, k), "backward-before-update") for k in range(chunks)]
    deps += [(s, Action(UPDATE, i - 1), "update order")] if i > 0 else []
    if norms:  # the global norm needs every stage's gradients, and the stages update in step
        others = [t for t in range(num_stages) if t != s]
        deps += [(t, Action(BACKWARD, i, k), "norm exchange") for t in others for k in range(chunks)]
        deps += [(t, Action(UPDATE, i - 1), "norm exchange") for t in others if i > 0]
    return deps


def check_schedule(schedule: Schedule, resources: Resources, num_chunks: int, ties: Ties | None = None) -> None:
    """Raise :class:`ScheduleError` (an ``AssertionError``) naming the first broken rule.

    Checked first from the per-stage orders alone (exactly-once, chunk order, forward
    before backward, update order, CSP), then against the ticks (one action at a time
    in list order, every dependency incl. cross-stage, CSP; with ``schedule.norms``, each
    update after every stage's backwards of its subnet and previous update; with ``ties``,
    see :func:`_check_ties`). Conflicts are recomputed pairwise, independently of :func:`build_schedule`.
    """
    res = validated(resources, num_chunks)
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
            for s_dep, dep, rule in _deps(s, a, num_stages, chunks, schedule.norms):
                ok = start[(s, a)] >= finish[(s_dep, dep)]
                _require(ok, rule, "{}@stage {} starts before {}@stage {} ends", a, s, dep, s_dep)
        first = [min(start[(s, Action(FORWARD, i, c))] for c in range(chunks)) for i in range(n)]
        for k, i in pairs[s]:
            ok = finish[(s, Action(UPDATE, k))] <= first[i]
            _require(ok, "CSP", "F{}@stage {} starts before conflicting U{} ends", i, s, k)
    if ties:
        _check_ties(schedule, res, ties)


def _check_ties(schedule: Schedule, res: tuple[tuple[frozenset[Hashable], ...], ...], ties: Ties) -> None:
    """The tied-resource rules: every subnet using a tied key anywhere has it on each owner stage (which steps
    it), and a subnet reading it on a stage after an owner starts its forwards there and on the owner (whose
    first forward sends the value on) only after the owner's update of the last earlier subnet using it."""
    for key, owners in ties.items():
        users = [i for i, per_stage in enumerate(res) if any(key in keys for keys in per_stage)]
        for owner in sorted(owners):
            for before, j in zip([-1, *users], users):
                _require(key in res[j][owner], "tied resource", "subnet {} uses tied {} but not on its owner stage {}",
                         j, key, owner)
                readers = [h for h in range(owner + 1, len(res[j])) if key in res[j][h]]
                if before < 0 or not readers:
                    continue
                done = schedule.finish[(owner, Action(UPDATE, before))]
                for h in (owner, *readers):
                    ok = schedule.start[(h, Action(FORWARD, j))] >= done
                    _require(ok, "tied value", "F{}.0@stage {} reads tied {} before U{}@owner stage {} ends", j, h, key,
                             before, owner)


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


class _TiedValues:
    """Which value of each tied resource a replay's stages hold: per stage and part ``(key, owner)``, the subnet
    whose update on the owner produced its copy (-1: the initial value). A value leaves the owner with a subnet's
    chunk-0 activation, passes from stage to stage with it, and a stage reading the key takes it before that
    subnet's first forward there (:mod:`.ties`)."""

    def __init__(self, res: tuple[tuple[frozenset[Hashable], ...], ...], ties: Ties, num_stages: int) -> None:
        self.res, self.last = res, num_stages - 1
        self.parts = [(key, owner) for key, owners in ties.items() for owner in sorted(owners)]
        self.held = [dict.fromkeys(self.parts, -1) for _ in range(num_stages)]
        self.carried: dict[tuple[int, int], dict[tuple[Hashable, int], int]] = {}  # (stage, subnet) -> values
        self.users = {key: [i for i, per_stage in enumerate(res) if any(key in keys for keys in per_stage)]
                      for key in ties}

    def forward(self, s: int, j: int) -> None:
        """``F(j, 0)`` on stage ``s``: take the values its activation carried, check those ``j`` reads, pass them on."""
        held, carried = self.held[s], self.carried.pop((s, j), {})
        for (key, owner), version in carried.items():
            if key in self.res[j][s]:
                held[(key, owner)] = version
        for key, owner in self.parts:
            if owner <= s and key in self.res[j][s]:
                expected = max([k for k in self.users[key] if k < j], default=-1)
                _require(held[(key, owner)] == expected, "tied value", "F{}.0@stage {} reads tied {} as updated by "
                         "subnet {} on stage {}, not by the last earlier user {}", j, s, key, held[(key, owner)], owner,
                         expected)
        if s < self.last:
            self.carried[(s + 1, j)] = {part: held[part] if part[1] == s else carried[part] for part in self.parts
                                        if part[1] <= s}

    def update(self, s: int, i: int) -> None:
        """``U(i)`` on stage ``s``: the parts it owns that ``i`` uses are now ``i``'s."""
        for key, owner in self.parts:
            if owner == s and key in self.res[i][s]:
                self.held[s][(key, owner)] = i


def replay(schedule: Schedule, num_stages: int, resources: Resources | None = None, ties: Ties | None = None) -> None:
    """Run the per-stage orders as independent processes would, with no global clock.

    Each stage walks its list; an F on ``s > 0`` (a B on ``s < S-1``) blocks until its
    activation (gradient) has been sent. Links are FIFO, sends never block, early
    messages are buffered. With ``schedule.norms`` a U runs the norm exchange of
    :class:`.grad_norm.NormExchange` in two halves, the stage blocked in between: up
    (take the norms from ``s+1``, send them with its own to ``s-1``), then down (take the
    verdict from ``s-1``, pass it to ``s+1``). With ``resources`` and ``ties``, the values of tied
    resources travel with the activations and every forward reading one must find the value after
    the last earlier update (:class:`ScheduleError` "tied value" otherwise). Raises
    :class:`DeadlockError` if no stage can progress before all finish, :class:`ScheduleError` if a
    sent message is never consumed.
    """
    if num_stages != len(schedule.stages):
        raise ValueError(f"num_stages={num_stages} but the schedule has {len(schedule.stages)} stages")
    values = _TiedValues(validated(resources, 1), ties, num_stages) if ties and resources is not None else None
    # inbox[s][0]: activations from s-1; inbox[s][1]: gradients from s+1.
    inbox = [(deque[tuple[int, int]](), deque[tuple[int, int]]()) for _ in range(num_stages)]
    early = [(Counter[tuple[int, int]](), Counter[tuple[int, int]]()) for _ in range(num_stages)]
    pc = [0] * num_stages
    sent_up = [False] * num_stages  # in the middle of a U: its up half is done
    last = num_stages - 1
    while any(pc[s] < len(order) for s, order in enumerate(schedule.stages)):
        progressed = False
        for s, order in enumerate(schedule.stages):
            while pc[s] < len(order):
                a = order[pc[s]]
                if a.kind == UPDATE and schedule.norms:
                    msg = (a.subnet, NORMS)
                    if not sent_up[s]:
                        if s < last and not _receive(inbox[s][1], early[s][1], msg):
                            break
                        if s > 0:
                            inbox[s - 1][1].append(msg)
                        sent_up[s] = progressed = True
                    if s > 0 and not _receive(inbox[s][0], early[s][0], msg):
                        break
                    if s < last:
                        inbox[s + 1][0].append(msg)
                    sent_up[s], pc[s], progressed = False, pc[s] + 1, True
                    if values is not None:
                        values.update(s, a.subnet)
                    continue
                msg, link = (a.subnet, a.chunk), int(a.kind == BACKWARD)
                needs_msg = (a.kind == FORWARD and s > 0) or (a.kind == BACKWARD and s < num_stages - 1)
                if needs_msg and not _receive(inbox[s][link], early[s][link], msg):
                    break
                if values is not None and a.kind != BACKWARD and a.chunk == 0:
                    (values.forward if a.kind == FORWARD else values.update)(s, a.subnet)
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
