"""Where a simulated stage's time goes: busy, idle by cause, and subnets in flight (:mod:`.planner`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule

__all__ = ["CAUSES", "SEND", "analyse_stage"]

#: Why a stage is idle: CSP (a forward held for an earlier subnet's update), a neighbour's activation or
#: gradient not yet computed (pipeline fill/drain), one computed but still in flight, work ready but later
#: in the engine's fixed order, and fixed per-window overheads.
CAUSES = ("dependency", "data", "communication", "order", "overhead")
#: Key of a stage's per-subnet costs: ticks from a backward's start to its gradient's send.
SEND = "send"


def analyse_stage(sched: Schedule, s: int, res: Sequence[Sequence[frozenset[Any]]], chunks: int, latency: int,
                  rendezvous: bool, pauses: Mapping[int, int] | None = None,
                  costs: Sequence[Sequence[Mapping[str, int]]] | None = None) -> tuple[int, dict[str, int], int, int]:
    """Busy ticks, idle ticks per cause, peak in-flight and in-flight tick-area of stage ``s``.

    In an idle gap, each action whose same-stage dependencies are done is ready (but later in the
    stage's fixed order), held by its CSP gate alone, waiting for a message in flight, or for one
    still to be computed. A tick counts as ``order`` if some action was ready, else ``dependency``
    if one was held by CSP alone, else ``communication`` if an input was in flight, else ``data``.
    With ``rendezvous`` (fixed orders) a message is in flight from when both its sender and the
    stage's next action are at it, until that action starts.
    """
    n, last, order = len(res), len(sched.stages) - 1, sched.stages[s]
    start, finish = sched.start, sched.finish
    gate: list[int] = []
    users: dict[Any, int] = {}
    for i in range(n):
        gate.append(max([users.get(key, -1) for key in res[i][s]], default=-1))
        users.update(dict.fromkeys(res[i][s], i))
    def produced(peer: int, kind: str) -> list[list[int | None]]:  # when each message was sent to stage s
        if not 0 <= peer <= last:
            return [[None] * chunks for _ in range(n)]
        if kind == BACKWARD and costs is not None:  # a deferring stage sends before its weight pass
            return [[start[(peer, Action(kind, i, c))] + costs[i][peer][SEND] for c in range(chunks)] for i in range(n)]
        return [[finish[(peer, Action(kind, i, c))] for c in range(chunks)] for i in range(n)]
    sent = {FORWARD: produced(s - 1, FORWARD), BACKWARD: produced(s + 1, BACKWARD)}
    unlocked = [finish[(s, Action(UPDATE, k))] if k >= 0 else -1 for k in gate]
    done = {FORWARD: [0] * n, BACKWARD: [0] * n}
    idle = dict.fromkeys(CAUSES, 0)
    busy = clock = 0

    def gap(g0: int, g1: int, following: Action) -> None:
        events: list[tuple[int, int, int]] = []  # (tick, 0 order / 1 dependency / 2 communication, +1 / -1)

        def span(kind: int, lo: int, hi: int) -> None:
            lo, hi = max(lo, g0), min(hi, g1)
            if lo < hi:
                events.extend([(lo, kind, 1), (hi, kind, -1)])
        for i in range(n):
            for kind in (FORWARD, BACKWARD):
                c = done[kind][i]
                if c >= chunks or (kind == BACKWARD and c >= done[FORWARD][i]):
                    continue  # finished, or its same-stage dependency is not done
                produced, arrived = sent[kind][i][c], 0
                if produced is not None and rendezvous and following == Action(kind, i, c):
                    span(2, produced, g1)
                    continue
                if produced is not None:
                    arrived = produced + (0 if rendezvous else latency)
                    span(2, produced, arrived)
                free = max(arrived, unlocked[i]) if kind == FORWARD and c == 0 else arrived
                span(1, arrived, free)  # a forward held by CSP alone once its input is here
                span(0, free, g1)  # ready, but the stage runs something else first (fixed order)
        level, t = [0, 0, 0], g0
        for tick, which, step in sorted(events) + [(g1, 0, 0)]:
            cause = next((c for c, on in zip(("order", "dependency", "communication"), level) if on), "data")
            idle[cause] += tick - t
            level[which] += step
            t = tick

    for p, a in enumerate(order):
        pause = min(pauses.get(p, 0), start[(s, a)] - clock) if pauses else 0
        idle["overhead"] += pause  # a window's overheads, before this stage's first action of the window
        clock += pause
        if start[(s, a)] > clock:
            gap(clock, start[(s, a)], a)
        busy += finish[(s, a)] - start[(s, a)]
        clock = finish[(s, a)]
        if a.kind != UPDATE:
            done[a.kind][a.subnet] += 1
    idle["data"] += sched.makespan - clock  # drained: waiting for the other stages to finish the window
    events = sorted([(start[(s, Action(FORWARD, i, 0))], 1) for i in range(n)] +
                    [(finish[(s, Action(UPDATE, i))], -1) for i in range(n)], key=lambda e: (e[0], e[1]))
    depth = peak = area = 0
    t = 0
    for tick, step in events:
        area += depth * (tick - t)
        depth, t = depth + step, tick
        peak = max(peak, depth)
    return busy, idle, peak, area
