"""The planner's per-stage accounting of a timed schedule: busy, idle by cause, subnets in flight."""

from __future__ import annotations

from lightning_naspipe.planning.stalls import CAUSES, analyse_stage
from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule

F, B, U = Action(FORWARD, 0), Action(BACKWARD, 0), Action(UPDATE, 0)
# One subnet on two stages, in ticks:  stage 0  F [0, 2)             B [7, 9) U [9, 10)
#                                      stage 1        F [2, 5) B [5, 7) U [7, 8)
TIMES = {(0, F): (0, 2), (1, F): (2, 5), (1, B): (5, 7), (1, U): (7, 8), (0, B): (7, 9), (0, U): (9, 10)}
ONE_SUBNET = Schedule(((F, B, U), (F, B, U)), {k: v[0] for k, v in TIMES.items()}, {k: v[1] for k, v in TIMES.items()})
NOTHING_SHARED = [[frozenset(), frozenset()]]


def test_a_stage_waiting_for_a_neighbour_still_computing_is_idle_for_data() -> None:
    busy, idle, peak, area = analyse_stage(ONE_SUBNET, 0, NOTHING_SHARED, 1, 0, True)
    assert busy == 5 and idle == dict.fromkeys(CAUSES, 0) | {"data": 5}  # stage 1's F and B
    assert peak == 1 and area == 10  # in flight from its F's start to its U's end
    busy, idle, _, _ = analyse_stage(ONE_SUBNET, 1, NOTHING_SHARED, 1, 0, True)
    assert busy == 6 and idle["data"] == 2 + 2  # stage 0's F before, its B and U after (the drain)


def test_an_input_sent_but_not_yet_received_is_communication() -> None:
    # With a latency, stage 1's F starts 1 tick after stage 0 sent: that tick is the message in flight.
    late = Schedule(ONE_SUBNET.stages, {**ONE_SUBNET.start, (1, F): 3}, ONE_SUBNET.finish)
    _, idle, _, _ = analyse_stage(late, 1, NOTHING_SHARED, 1, 1, False)
    assert idle["communication"] == 1 and idle["data"] == 2 + 2
