"""Offload: results bitwise equal with it on and off; residency invariants; accounting."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.engine import Engine
from lightning_naspipe.offload import Offloader, WindowResidency
from lightning_naspipe.schedule import FORWARD, UPDATE, build_schedule
from test_engine import FakeModule, batches, make_supernet


def _train(offload: bool, window: int, budget: int | None = None) -> tuple[FakeModule, Offloader | None]:
    module = FakeModule(make_supernet())
    blocks = range(len(module.supernet))
    offloader = Offloader(module.supernet.stage_resources(blocks), module.optimizer, torch.device("cpu"),
                          budget) if offload else None
    engine = Engine([blocks], chunks=2, offloader=offloader)
    data = batches(8)
    for start in range(0, len(data), window):
        engine.train_window(module, data[start:start + window], start)  # type: ignore[arg-type]
    return module, offloader


@pytest.mark.parametrize("window", [1, 4])
def test_offload_is_bitwise_exact(window: int) -> None:
    plain, _ = _train(False, window)
    offloaded, offloader = _train(True, window)
    for a, b in zip(plain.supernet.state_dict().values(), offloaded.supernet.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(plain.optimizer.state_dict()["state"].values(), offloaded.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert offloader is not None
    stats = offloader.stats
    assert stats.device_bytes == 0  # everything back in host memory after each window
    assert 0 < stats.peak_device_bytes < stats.partition_bytes * 2  # grads and new Adam state included
    assert stats.prefetch_hits + stats.prefetch_misses > 0


def test_parameters_live_in_the_host_copy_between_windows() -> None:
    module, offloader = _train(True, 4)
    assert offloader is not None
    for key, resource in offloader._resources.items():
        assert not offloader.is_resident(key)
        assert all(p.data.data_ptr() == h.data_ptr() for p, h in zip(resource.params, resource.host))


def test_a_subnet_larger_than_the_budget_is_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="offload_budget_bytes"):
        _train(True, 2, budget=64)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), subnets=st.integers(1, 12), chunks=st.integers(1, 2),
       budget_room=st.one_of(st.none(), st.integers(0, 3)))
def test_residency_invariants(seed: int, subnets: int, chunks: int, budget_room: int | None) -> None:
    """Nothing is evicted while an in-flight subnet needs it; nothing computes on a host copy;
    device bytes match the resident copies and stay within the budget beyond what must be in flight."""
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(6)]
    modules = {k: _Block(rng.randint(1, 4)) for k in keys}
    per_key = {k: modules[k].weight.numel() * 4 for k in keys}
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
                assert modules[key].weight.data_ptr() != offloader._resources[key].host[0].data_ptr()
        elif action.kind == UPDATE:
            residency.after_update(action.subnet)
            in_flight.discard(action.subnet)
        needed = {k for s in in_flight for k in resources[s]}
        assert all(offloader.is_resident(k) for k in needed), "evicted while in flight"
        assert offloader.stats.device_bytes == sum(r.nbytes for r in offloader._resident.values())
        if budget is not None:
            assert offloader.stats.device_bytes <= max(budget, sum(per_key[k] for k in needed))
    residency.finish()
    assert offloader.stats.device_bytes == 0
