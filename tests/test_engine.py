"""The engine against a hand-written sequential loop in plain torch (no Lightning)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
import lightning_naspipe.pipeline.runtime.window_plan as window_plan_module
from inprocess import train_pipelined
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.pipeline.runtime.window_plan import plan_window
from lightning_naspipe.pipeline.sampling.keyed import keyed_rng, uniform_architecture

SEED = 11


def make_supernet() -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(
        nn.Linear(5, 7),
        lnp.ChoiceBlock([nn.Sequential(nn.Linear(7, 7), nn.Dropout(0.5)), nn.Identity(), nn.BatchNorm1d(7)]),
        lnp.ChoiceBlock([nn.Linear(7, 7), nn.Tanh()], label="pair"),
        lnp.ChoiceBlock([nn.Sequential(nn.Dropout(0.3), nn.Linear(7, 7)), nn.ReLU()], label="pair"),
        nn.Linear(7, 2),
    )


class FakeModule:
    """The parts of a NASPipe LightningModule the engine uses, without Lightning."""

    naspipe_seed = SEED

    def __init__(self, supernet: lnp.Supernet) -> None:
        self.supernet = supernet
        self.optimizer = torch.optim.Adam(supernet.parameters(), lr=0.1)
        self.trainer = SimpleNamespace(lr_scheduler_configs=[], callback_metrics={})

    def sample_subnet(self, index: int) -> dict[str, int]:
        return uniform_architecture(self.supernet.labels, self.naspipe_seed, index)

    def sample_step(self, step: int) -> list[dict[str, int]]:
        return [self.sample_subnet(step)]

    def pipeline_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizers(self) -> Any:
        return SimpleNamespace(optimizer=self.optimizer, step=self.optimizer.step)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 5, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(count)]


def reference_training(supernet: lnp.Supernet, data: list, chunks: int) -> tuple[lnp.Supernet, dict, list]:
    """Subnet i on batch i, one after the other; a plain optimizer step (others have no grads)."""
    optimizer = torch.optim.Adam(supernet.parameters(), lr=0.1)
    losses = []
    for i, (x, y) in enumerate(data):
        architecture = uniform_architecture(supernet.labels, SEED, i)
        total = torch.zeros(())
        for c, (xc, yc) in enumerate(zip(x.tensor_split(chunks), y.tensor_split(chunks))):
            h = xc
            for b in range(len(supernet)):
                with keyed_rng(torch.device("cpu"), SEED, i, b, c):
                    h = supernet.block_op(b, architecture)(h)
            loss = nn.functional.cross_entropy(h, yc)
            if chunks > 1:
                loss = loss * (len(xc) / len(x))
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return supernet, optimizer.state_dict(), losses


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("chunks", [1, 2])
def test_engine_matches_hand_written_sequential_loop(window: int, chunks: int) -> None:
    data = batches(8)
    ref_net, ref_optim, ref_losses = reference_training(make_supernet(), data, chunks)

    module = FakeModule(make_supernet())
    engine = Engine([range(len(module.supernet))], chunks=chunks)
    losses: list[torch.Tensor] = []
    for start in range(0, len(data), window):
        losses += engine.train_window(module, data[start:start + window], start).losses  # type: ignore[arg-type]

    for (name, a), b in zip(ref_net.state_dict().items(), module.supernet.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    state = module.optimizer.state_dict()["state"]
    assert state.keys() == ref_optim["state"].keys()
    for key in state:
        for field in state[key]:
            assert torch.equal(state[key][field], ref_optim["state"][key][field]), (key, field)


def test_untouched_candidates_keep_no_optimizer_state() -> None:
    module = FakeModule(make_supernet())
    Engine([range(len(module.supernet))]).train_window(module, batches(1), 0)
    architecture = module.sample_subnet(0)
    used = {id(p) for b in range(len(module.supernet)) for p in module.supernet.block_op(b, architecture).parameters()}
    for p in module.supernet.parameters():
        assert (p in module.optimizer.state) == (id(p) in used)
        assert p.grad is None  # cleared after the subnet's update


def test_dropout_is_keyed_not_drawn_from_the_global_rng() -> None:
    module = FakeModule(make_supernet())
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    Engine([range(len(module.supernet))]).train_window(module, batches(4), 0)
    assert torch.equal(before, torch.get_rng_state())


def test_bad_sampler_output_is_reported() -> None:
    module = FakeModule(make_supernet())
    module.sample_subnet = lambda index: {"block1": 9, "pair": 0}  # type: ignore[method-assign]
    with pytest.raises(lnp.NASPipeConfigError, match="block1"):
        Engine([range(len(module.supernet))]).train_window(module, batches(1), 0)


def test_scalar_loss_is_required() -> None:
    module = FakeModule(make_supernet())
    module.compute_loss = lambda output, batch: output  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="scalar"):
        Engine([range(len(module.supernet))]).train_window(module, batches(1), 0)


def test_copy_of_module_trains_identically() -> None:
    # Determinism across fresh processes is the same property as across copies here.
    net = make_supernet()
    a, b = FakeModule(copy.deepcopy(net)), FakeModule(copy.deepcopy(net))
    for module in (a, b):
        Engine([range(len(net))], chunks=2).train_window(module, batches(5), 100)
    for x, y in zip(a.supernet.parameters(), b.supernet.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("schedule", ["one_in_flight", "gpipe"])
def test_baseline_schedules_stay_exact(schedule: str) -> None:
    data = batches(6)
    ref_net, _, _ = reference_training(make_supernet(), data, 2)
    module = FakeModule(make_supernet())
    Engine([range(len(module.supernet))], chunks=2, schedule=schedule).train_window(module, data, 0)
    for a, b in zip(ref_net.parameters(), module.supernet.parameters()):
        assert torch.equal(a, b)


def test_scheduling_resources_per_mode() -> None:
    from lightning_naspipe.schedule.schedules import scheduling_resources
    from lightning_naspipe.schedule.schedules import build_schedule

    real = [[frozenset({1}), frozenset()], [frozenset({2}), frozenset({3})], [frozenset({1}), frozenset()]]
    csp, one, free = (build_schedule(scheduling_resources(m, real), 1) for m in ("csp", "one_in_flight", "async"))
    assert free.makespan <= csp.makespan < one.makespan
    # One in flight: subnet k+1 starts on stage 0 only after subnet k's update there.
    order = [str(a) for a in one.stages[0]]
    assert order == ["F0.0", "B0.0", "U0", "F1.0", "B1.0", "U1", "F2.0", "B2.0", "U2"]
    with pytest.raises(ValueError, match="unknown schedule"):
        scheduling_resources("fast", real)


def test_metrics_name_each_source_and_are_empty_without_one() -> None:
    from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry

    assert Engine([range(2)]).metrics() == {}
    found = Engine([range(2)], telemetry=StageTelemetry(0)).metrics()
    assert found and all(name.startswith("telemetry/") for name in found)
    assert "telemetry/busy_s" in found


def _lookahead_supernet() -> lnp.Supernet:
    """No block every subnet trains, so the next window's forwards can run early; BatchNorm keeps the
    subnets that choose it in their window on its stage."""
    torch.manual_seed(1)
    return lnp.Supernet(
        lnp.ChoiceBlock([nn.Linear(5, 7), nn.Sequential(nn.Linear(5, 7), nn.Tanh())]),
        lnp.ChoiceBlock([nn.Linear(7, 7), nn.BatchNorm1d(7), nn.Sequential(nn.Dropout(0.3), nn.Linear(7, 7))]),
        lnp.ChoiceBlock([nn.Linear(7, 7), nn.ReLU()]),
        lnp.ChoiceBlock([nn.Linear(7, 2), nn.Sequential(nn.Tanh(), nn.Linear(7, 2))]),
    )


@pytest.mark.parametrize(("ranges", "chunks", "epoch_ends"), [
    ([range(0, 2), range(2, 4)], 1, ()),
    ([range(0, 1), range(1, 3), range(3, 4)], 2, ()),
    ([range(0, 2), range(2, 4)], 2, (6,)),
])
def test_lookahead_runs_the_next_windows_forwards_early_with_the_same_result(
        monkeypatch: pytest.MonkeyPatch, ranges: list[range], chunks: int, epoch_ends: tuple[int, ...]) -> None:
    data = batches(12)
    reference = FakeModule(_lookahead_supernet())
    engine = Engine([range(4)], chunks=chunks)
    expected = [loss for start in range(0, 12, 3) for loss in engine.train_window(reference, data[start:start + 3],
                                                                                  start).losses]
    carried: list[int] = []
    real_plan_step = window_plan_module.plan_step

    def recording(*args: Any, **kwargs: Any) -> Any:
        plan = real_plan_step(*args, **kwargs)
        carried.append(len(plan.carried))
        return plan

    monkeypatch.setattr(window_plan_module, "plan_step", recording)
    module = FakeModule(_lookahead_supernet())
    losses = train_pipelined(module, ranges, data, 3, chunks, epoch_ends=epoch_ends)  # type: ignore[arg-type]
    assert sum(carried) > 0, "some forwards ran in the window before theirs"
    assert all(torch.equal(a, b) for a, b in zip(expected, losses)) and len(losses) == 12
    for (name, a), b in zip(reference.supernet.state_dict().items(), module.supernet.state_dict().values()):
        assert torch.equal(a, b), name
    ref_state, state = reference.optimizer.state_dict()["state"], module.optimizer.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    assert all(torch.equal(ref_state[k][f], state[k][f]) for k in ref_state for f in ref_state[k])


def test_a_forward_through_buffers_is_not_run_ahead() -> None:
    """BatchNorm's running statistics change in a training forward, and a checkpoint between the
    windows would hold them: such a forward stays in its own window, on the stage of that block only."""
    supernet = _lookahead_supernet()
    label = "block1"

    def window(first: int, picks: list[int]) -> Window:
        # This window's subnets share candidate 0 everywhere; the next window's share nothing with them.
        other = {"block0": 1, "block2": 1, "block3": 1} if first else {}
        architectures = [{**{name: 0 for name in supernet.labels}, **other, label: pick} for pick in picks]
        return Window(first, architectures, [[(None, 1.0)] for _ in picks])

    ranges = [range(0, 1), range(1, 2), range(2, 4)]
    early = {}
    for pick in (1, 2):  # BatchNorm, or a Linear
        plan = plan_window(supernet, window(0, [0, 0, 0]), ranges, "csp", 1, upcoming=window(3, [pick]))
        early[pick] = {(s, a.subnet) for s, a in plan.carried}
    assert early[2] == {(0, 0), (1, 0)}, "subnet 3 forwards ahead on every stage but the last"
    assert early[1] == {(0, 0)}, "but not through BatchNorm on stage 1"


@pytest.mark.parametrize("chunks", [1, 2])
def test_stages_behind_a_shared_stem_measure_deferred_weight_grads_at_chunks_1_with_the_same_result(
        chunks: int) -> None:
    """Block 0 (a trainable stem) is in every subnet, so every window is serialised for the later stages:
    at ``chunks=1`` they alternate deferring and not over their trial windows (measured, so which way
    wins is up to the machine); at ``chunks=2`` they never defer. Results are the sequential ones."""
    data = batches(24)
    ref_net, ref_optim, ref_losses = reference_training(make_supernet(), data, chunks)
    module = FakeModule(make_supernet())
    engines: list[Engine] = []
    losses = train_pipelined(module, [range(0, 2), range(2, 4), range(4, 5)], data, 4, chunks,  # type: ignore[arg-type]
                             engines=engines)
    assert engines[0].windows_deferred == 0
    if chunks == 1:
        assert all(e.windows_deferred >= e.deferral.trials for e in engines[1:])
    else:
        assert all(e.windows_deferred == 0 for e in engines[1:])
    for (name, a), b in zip(ref_net.state_dict().items(), module.supernet.state_dict().values()):
        assert torch.equal(a, b), name
    assert len(losses) == 24 and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    state = module.optimizer.state_dict()["state"]
    assert state.keys() == ref_optim["state"].keys()
    assert all(torch.equal(state[k][f], ref_optim["state"][k][f]) for k in state for f in state[k])
