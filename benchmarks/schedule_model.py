"""What the schedule alone predicts: a clock-free model to read noisy measurements against.

The engine runs, per stage, the action order that ``build_schedule`` produces (with unit costs).
This model replays exactly those orders with idealised costs per stage (forward 1, backward 2,
update 0.05 of a subnet's share of work, split evenly over micro-batches; no communication, no
Python overhead, perfectly balanced stages) and returns the speed-up over running the same subnets
on one device. Measured ratios below it show what communication, imbalance and overheads cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_naspipe import Supernet
from lightning_naspipe.schedule.schedules import scheduling_resources
from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, Action
from lightning_naspipe.schedule.schedules import build_schedule

FORWARD_COST, BACKWARD_COST, UPDATE_COST = 1.0, 2.0, 0.05


def replay(orders: Sequence[Sequence[Action]], cost: Callable[[int, Action], float]) -> float:
    """Makespan of per-stage ``orders`` when each stage runs its list in order, waiting for the
    previous stage's forward and the next stage's backward of the same (subnet, chunk)."""
    stages = len(orders)
    finished: dict[tuple[int, Action], float] = {}
    clock, position = [0.0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                peer = s - 1 if action.kind == FORWARD else s + 1 if action.kind == BACKWARD else -1
                ready = 0.0
                if 0 <= peer < stages:
                    if (peer, action) not in finished:
                        break  # its input is not computed yet; let the other stages advance
                    ready = finished[(peer, action)]
                clock[s] = max(clock[s], ready) + cost(s, action)
                finished[(s, action)] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("replay deadlocked")  # the schedule's own checks rule this out
    return max(clock)


def modelled_speedup(supernet: Supernet, ranges: Sequence[range], sample: Callable[[int], dict[str, int]],
                     schedule: str, chunks: int, window: int, windows: int = 8) -> float:
    """Predicted subnets/s of ``schedule`` on ``len(ranges)`` stages over one device, averaged
    over ``windows`` windows of subnets ``sample(0), sample(1), ...``."""
    per_subnet = FORWARD_COST + BACKWARD_COST + UPDATE_COST

    def cost(stage: int, action: Action) -> float:
        if action.kind == FORWARD:
            return FORWARD_COST / chunks
        return BACKWARD_COST / chunks if action.kind == BACKWARD else UPDATE_COST

    total = 0.0
    for w in range(windows):
        archs = [sample(w * window + k) for k in range(window)]
        resources: Any = [[supernet.resources(r, a) for r in ranges] for a in archs]
        orders = build_schedule(scheduling_resources(schedule, resources), chunks).stages
        total += window * len(ranges) * per_subnet / replay(orders, cost)
    return total / windows


def ranges_of(balance: Sequence[int]) -> list[range]:
    """``[3, 2]`` -> ``[range(0, 3), range(3, 5)]``."""
    starts = [sum(balance[:i]) for i in range(len(balance))]
    return [range(start, start + size) for start, size in zip(starts, balance)]
