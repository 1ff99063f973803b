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
from lightning_naspipe.offload import Offloader, WindowResidency, estimated_bytes
from lightning_naspipe.supernet import ResourceState
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


@pytest.mark.parametrize("make, factor", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.Adam(ps), 2),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), 3),
])
def test_optimizer_state_factor(make: object, factor: int) -> None:
    from lightning_naspipe.offload import optimizer_state_factor

    assert optimizer_state_factor(make([nn.Parameter(torch.zeros(2))])) == factor  # type: ignore[operator]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), subnets=st.integers(1, 16), stages=st.integers(1, 3), chunks=st.integers(1, 2))
def test_memory_conflicts_keep_in_flight_within_budget(seed: int, subnets: int, stages: int, chunks: int) -> None:
    from lightning_naspipe.offload import memory_conflicts
    from lightning_naspipe.schedule import check_schedule, replay

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


def lnp_action(kind: str, subnet: int) -> object:
    from lightning_naspipe.schedule import Action

    return Action(kind, subnet, 0)


def test_strategy_budget_is_respected_and_exact() -> None:
    from helpers import ToyNet, assert_same_state, full_state, train  # noqa: F401

    reference, ref_trainer = train(max_epochs=1)
    budget = 5_000  # one subnet needs <= 4784 bytes here; unbudgeted, the peak is 6552
    model, trainer = train(lnp.NASPipeStrategy(window=8, offload=True, offload_budget_bytes=budget), max_epochs=1)
    assert_same_state(full_state(reference, ref_trainer), full_state(model, trainer))
    assert trainer.callback_metrics["offload/peak_device_bytes_stage0"] <= budget
    with pytest.raises(lnp.NASPipeConfigError, match="offload_budget_bytes"):
        train(lnp.NASPipeStrategy(window=8, offload=True, offload_budget_bytes=100), max_epochs=1)


def test_a_failed_evaluation_releases_what_it_acquired(monkeypatch: pytest.MonkeyPatch) -> None:
    module, offloader = _train(True, 4)
    assert offloader is not None
    engine = Engine([range(len(module.supernet))], offloader=offloader)
    from lightning_naspipe.executor import StageExecutor

    def fails(*args: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(StageExecutor, "forward_only", fails)
    architecture = {label: 0 for label in module.supernet.labels}
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.evaluate(module, batches(1)[0], architecture)  # type: ignore[arg-type]
    assert all(r.users == 0 for r in offloader._resident.values())
    offloader.close()
    offloader.close()  # idempotent


def test_fit_leaves_no_copy_thread_and_the_supernet_whole() -> None:
    import threading

    from helpers import toy_loader, train

    for _ in range(2):
        model, trainer = train(lnp.NASPipeStrategy(window=4, offload=True), max_steps=4)
        assert not [t for t in threading.enumerate() if t.name.startswith("naspipe-prefetch")]
        model.supernet.local_blocks = range(1)  # as a stage process holds it during fit
        trainer.validate(model, toy_loader(samples=16, shuffle=False), verbose=False)
        assert model.supernet.local_blocks is None
