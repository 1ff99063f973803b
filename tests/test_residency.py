"""The offload policy of a window: residency by the schedule, and memory-bounded scheduling."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_naspipe.pipeline.offload.offload import Offloader, estimated_bytes
from lightning_naspipe.pipeline.offload.residency import WindowResidency, memory_conflicts
from lightning_naspipe.schedule.actions import FORWARD, UPDATE, Action
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.schedule.rules import check_schedule, replay
from lightning_naspipe.space.supernet import ResourceState


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))


def _state(module: nn.Module) -> ResourceState:
    return ResourceState(tuple(module.parameters()), tuple((m, n) for m in module.modules() for n in m._buffers))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), subnets=st.integers(1, 12), chunks=st.integers(1, 2),
       budget_room=st.one_of(st.none(), st.integers(0, 3)))
def test_residency_invariants(seed: int, subnets: int, chunks: int, budget_room: int | None) -> None:
    """Nothing is evicted while an in-flight subnet needs it; nothing computes on a host copy;
    device bytes match the resident copies and stay within the budget beyond what must be in flight."""
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(6)]
    modules = {k: _state(_Block(rng.randint(1, 4))) for k in keys}
    per_key = {k: estimated_bytes(modules[k], None) for k in keys}  # what the offloader budgets per resource
    resources = [frozenset(rng.sample(keys, rng.randint(0, 3))) for _ in range(subnets)]
    biggest = max((sum(per_key[k] for k in r) for r in resources), default=0)
    # In-flight sets may overlap; the budget only has to hold them plus optional room.
    budget = None if budget_room is None else biggest * subnets + budget_room * 4
    offloader = Offloader(modules, None, torch.device("cpu"), budget)
    schedule = build_schedule([[r] for r in resources], chunks)
    order = [a.subnet for a in schedule.stages[0] if a.kind == FORWARD and a.chunk == 0]
    residency = WindowResidency(offloader, order, resources)
    in_flight: set[int] = set()
    for action in schedule.stages[0]:
        if action.kind == FORWARD:
            if action.chunk == 0:
                residency.before_forward(action.subnet)
                in_flight.add(action.subnet)
            for key in resources[action.subnet]:
                assert offloader.is_resident(key), f"{key} computed on while not resident"
                assert modules[key].params[0].data_ptr() != offloader._resources[key].host[0].data_ptr()
        elif action.kind == UPDATE:
            residency.after_update(action.subnet)
            in_flight.discard(action.subnet)
        needed = {k for s in in_flight for k in resources[s]}
        assert all(offloader.is_resident(k) for k in needed), "evicted while in flight"
        assert offloader.stats.device_bytes == sum(r.nbytes for r in offloader._resident.values())
        if budget is not None:
            reserved = sum(per_key[k] for k in offloader._resident)
            assert reserved <= max(budget, sum(per_key[k] for k in needed))
    residency.finish()
    assert offloader.stats.device_bytes == 0


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), subnets=st.integers(1, 16), stages=st.integers(1, 3), chunks=st.integers(1, 2))
def test_memory_conflicts_keep_in_flight_within_budget(seed: int, subnets: int, stages: int, chunks: int) -> None:
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(8)]
    sizes = {k: rng.randint(1, 10) for k in keys}
    real = [[frozenset(rng.sample(keys, rng.randint(0, 3))) for _ in range(stages)] for _ in range(subnets)]
    budget = max([30] + [sum(sizes[k] for k in r) for sub in real for r in sub])
    per_stage = [memory_conflicts([sub[s] for sub in real], sizes, budget) for s in range(stages)]
    planned = [[per_stage[s][i] for s in range(stages)] for i in range(subnets)]
    schedule = build_schedule(planned, chunks)
    check_schedule(schedule, planned, chunks)
    replay(schedule, stages)
    for s in range(stages):
        for i in range(subnets):
            start = schedule.start[(s, lnp_action(FORWARD, i))]
            # Subnets started but not yet updated on s when F(i, 0) starts, i included.
            live = [k for k in range(subnets) if schedule.start[(s, lnp_action(FORWARD, k))] <= start
                    and schedule.finish[(s, lnp_action(UPDATE, k))] > start]
            assert sum(sizes[key] for key in set().union(*(real[k][s] for k in live))) <= budget


def lnp_action(kind: str, subnet: int) -> Action:
    return Action(kind, subnet, 0)
