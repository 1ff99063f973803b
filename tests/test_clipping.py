"""Gradient clipping (lightning_naspipe.pipeline.exactness.clipping): Lightning's order and settings under the mixin,
and the
same bits on any number of stages (the multi-process run: tests/test_pipeline.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from helpers import NAMESPACES, TOY_NETS, ToyBody, toy_loader, train
from inprocess import train_pipelined
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from test_engine import FakeModule

MAX_NORM = 0.2  # below most subnets' gradient norm on ToyNet: clipping scales most updates
CLIP_VALUE = 0.02


class ClippingModule(FakeModule):
    """ToyNet's supernet (stem, head, BatchNorm, dropout) with Adam, stepped as Lightning's precision plugin
    steps: the ``on_before_optimizer_step`` hooks clip (``clip`` says how), then the optimizer steps. Stage
    threads share it (tests/inprocess.py), so each keeps an optimizer of its own, over every parameter."""

    def __init__(self, clip: str) -> None:
        torch.manual_seed(0)
        super().__init__(ToyBody().supernet)
        self.clip = clip
        self.stage_optimizers: dict[int, torch.optim.Optimizer] = {}
        self.totals: list[torch.Tensor] = []

    def optimizers(self) -> Any:
        optimizer = self.stage_optimizers.setdefault(
            threading.get_ident(), torch.optim.Adam(self.supernet.parameters(), lr=0.05))
        return SimpleNamespace(optimizer=optimizer, step=lambda: self._step(optimizer))

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.clip == "norm":  # what Lightning's clip_gradients passes: the optimizer's (restricted) parameters
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            self.totals.append(torch.nn.utils.clip_grad_norm_(parameters, MAX_NORM))
        elif self.clip == "hand-written norm":
            self.totals.append(torch.nn.utils.clip_grad_norm_(self.supernet.parameters(), MAX_NORM))
        elif self.clip == "hand-written value":
            torch.nn.utils.clip_grad_value_(self.supernet.parameters(), CLIP_VALUE)
        optimizer.step()

    def optimizer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for optimizer in self.stage_optimizers.values():
            state = optimizer.state_dict()["state"]
            assert not merged.keys() & state.keys(), "each parameter is stepped on one stage only"
            merged.update(state)
        return merged


def _batches(count: int) -> list[Any]:
    return list(toy_loader(samples=8 * count, shuffle=False))


def _assert_same(reference: ClippingModule, ref_losses: list[torch.Tensor], module: ClippingModule,
                 losses: list[torch.Tensor]) -> None:
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for (name, a), b in zip(reference.supernet.state_dict().items(), module.supernet.state_dict().values()):
        assert torch.equal(a, b), name
    ref_state, state = reference.optimizer_state(), module.optimizer_state()
    assert ref_state.keys() == state.keys()
    assert all(torch.equal(ref_state[k][f], state[k][f]) for k in ref_state for f in ref_state[k])


def _sequential(clip: str, data: list[Any], window: int, chunks: int) -> tuple[ClippingModule, list[torch.Tensor]]:
    module = ClippingModule(clip)
    engine = Engine([range(len(module.supernet))], chunks=chunks)
    losses = [loss for start in range(0, len(data), window)
              for loss in engine.train_window(module, data[start:start + window], start).losses]  # type: ignore[arg-type]
    return module, losses  # type: ignore[return-value]


@pytest.mark.parametrize(("clip", "ranges", "chunks", "choice_stem", "defer"), [
    ("norm", [range(0, 2), range(2, 5)], 1, False, None),
    ("norm", [range(0, 1), range(1, 3), range(3, 5)], 2, False, None),
    ("norm", [range(0, 1), range(1, 3), range(3, 5)], 1, True, True),
    ("hand-written norm", [range(0, 3), range(3, 5)], 1, False, None),
    ("hand-written value", [range(0, 2), range(2, 4), range(4, 5)], 2, False, None),
])
def test_clipping_on_stages_equals_one_device(monkeypatch: pytest.MonkeyPatch, clip: str, ranges: list[range],
                                              chunks: int, choice_stem: bool, defer: bool | None) -> None:
    """Norm clipping over the optimizer's parameters (Lightning's clip_gradients) or over self.parameters()
    (by hand) exchanges per-tensor norms between stages; value clipping clips this subnet's gradients only.
    With a choice of stems the next window's forwards run in this one's drain (lookahead), and with
    ``defer`` the later stages compute weight gradients after sending input gradients."""
    if choice_stem:
        monkeypatch.setenv("LNP_TEST_CHOICE_STEM", "1")
    data = _batches(12)
    reference, ref_losses = _sequential(clip, data, 4, chunks)
    module = ClippingModule(clip)
    engines: list[Engine] = []
    losses = train_pipelined(module, ranges, data, 4, chunks, engines=engines,  # type: ignore[arg-type]
                             defer_weight_grads=defer, clip_norms="norm" in clip)
    _assert_same(reference, ref_losses, module, losses)
    if choice_stem:
        assert engines[0].forwards_ahead > 0 and engines[1].windows_deferred > 0
    if "norm" in clip:
        assert sum(bool(total > MAX_NORM) for total in reference.totals) >= 10, "clipping scaled most updates"
        assert len(module.totals) == len(ranges) * len(data), "every stage clipped every subnet"
        assert all(torch.equal(a, b) for a, b in zip(reference.totals, module.totals[::len(ranges)]))


def test_a_norm_clip_without_a_planned_exchange_is_refused_on_several_stages() -> None:
    module = ClippingModule("hand-written norm")
    with pytest.raises(lnp.NASPipeConfigError, match="outside configure_gradient_clipping.*gradient_clip_val"):
        train_pipelined(module, [range(0, 2), range(2, 5)], _batches(4), 4)  # type: ignore[arg-type]
    one_stage, _ = _sequential("hand-written norm", _batches(4), 4, 1)  # one stage: torch's own, as ever
    assert len(one_stage.totals) == 4


# -- torch's clipping functions during one subnet's update on a stage of several -------------------------


def _update(exchange: bool) -> tuple[Any, list[nn.Parameter], torch.optim.Optimizer]:
    from lightning_naspipe.pipeline.exactness.clipping import UpdateClipping
    from lightning_naspipe.pipeline.exactness.grad_norm import NormExchange

    params = [nn.Parameter(torch.ones(3)) for _ in range(3)]
    for n, p in enumerate(params):
        p.grad = torch.full((3,), float(n + 2))
    optimizer = torch.optim.SGD(params, lr=0.1)
    one_stage = (lambda index: NormExchange(None, 0, 1, index, torch.device("cpu"))) if exchange else None  # type: ignore[arg-type]
    clipping = UpdateClipping(0, 2, one_stage)
    module = SimpleNamespace(trainer=SimpleNamespace())
    return clipping.step(module, optimizer, params[:2], 7), params, optimizer


def test_during_an_update_torchs_clipping_touches_this_subnets_gradients_only() -> None:
    """Parameter 2 holds another in-flight subnet's gradient (or a partial one): left alone."""
    step, params, _ = _update(exchange=True)
    with step:
        torch.nn.utils.clip_grad_value_(params, 2.5)
    assert [p.grad.tolist() for p in params] == [[2.0] * 3, [2.5] * 3, [4.0] * 3]  # type: ignore[union-attr]
    step, params, _ = _update(exchange=True)
    with step:
        total = torch.nn.utils.clip_grad_norm_(params, 1.0)
        with pytest.raises(lnp.NASPipeConfigError, match="twice"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert torch.equal(total, torch.nn.utils.get_total_norm([torch.full((3,), 2.0), torch.full((3,), 3.0)]))
    assert torch.equal(params[2].grad, torch.full((3,), 4.0))  # type: ignore[arg-type]
    step, params, _ = _update(exchange=False)
    with step, pytest.raises(lnp.NASPipeConfigError, match="subnet 7's optimizer step on stage 0 of 2"):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert torch.equal(torch.nn.utils.clip_grad_norm_(params, 100.0), torch.nn.utils.get_total_norm(
        [p.grad for p in params]))  # type: ignore[misc]  # outside an update: torch's own


# -- Lightning: the Trainer's settings, the hook order, one device and the strategy's one stage -------------


def _variant(namespace: Any, name: str, **methods: Any) -> type:
    return type(name, (TOY_NETS[namespace],), methods)


def _state(model: Any, trainer: Any) -> list[torch.Tensor]:
    state = [t for t in model.state_dict().values()]
    optimizer = trainer.optimizers[0].state_dict()["state"]
    return state + [t for k in sorted(optimizer) for t in optimizer[k].values()] + list(model.losses.values())


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("namespace", NAMESPACES.values(), ids=NAMESPACES.keys())
def test_trainer_gradient_clip_val_clips_as_the_hand_written_call_on_one_device(namespace: Any) -> None:
    """Lightning's validator refuses gradient_clip_val under manual optimization; with the mixin it is set
    aside while Lightning validates, and each subnet's step clips as automatic optimization would."""
    def by_hand(self: Any, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)

    hand = _state(*train(model_cls=_variant(namespace, "Hand", on_before_optimizer_step=by_hand), namespace=namespace,
                         max_epochs=1))
    clipped = _state(*train(namespace=namespace, max_epochs=1, gradient_clip_val=MAX_NORM))
    assert _equal(hand, clipped)
    assert not _equal(clipped, _state(*train(namespace=namespace, max_epochs=1)))
    one_stage = _state(*train(lnp.NASPipeStrategy(window=4), namespace=namespace, max_epochs=1,
                              gradient_clip_val=MAX_NORM))
    assert _equal(clipped, one_stage)


def test_value_clipping_and_a_configure_gradient_clipping_override() -> None:
    def by_hand(self: Any, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_value_(self.parameters(), CLIP_VALUE)

    def override(self: Any, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=MAX_NORM, gradient_clip_algorithm="norm")

    pl = NAMESPACES["pytorch_lightning"]
    hand = _state(*train(model_cls=_variant(pl, "HandValue", on_before_optimizer_step=by_hand), max_epochs=1))
    assert _equal(hand, _state(*train(max_epochs=1, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")))
    overridden = _variant(pl, "Override", configure_gradient_clipping=override)
    assert _equal(_state(*train(model_cls=overridden, max_epochs=1)),
                  _state(*train(max_epochs=1, gradient_clip_val=MAX_NORM)))


def test_lightnings_order_hooks_then_configure_gradient_clipping_then_the_step() -> None:
    pl = NAMESPACES["pytorch_lightning"]
    events: list[Any] = []

    def hook(self: Any, optimizer: Any) -> None:
        events.append(("hook", self.trainer.gradient_clip_val, self.global_step))

    def override(self: Any, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
        events.append(("clip", gradient_clip_val, gradient_clip_algorithm, len(optimizer.param_groups[0]["params"])))
        super(type(self), self).configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    model, trainer = train(model_cls=_variant(pl, "Order", on_before_optimizer_step=hook,
                                              configure_gradient_clipping=override), max_steps=3, gradient_clip_val=0.5)
    assert [e[0] for e in events] == ["hook", "clip"] * 3
    assert [e[1:] for e in events[::2]] == [(0.5, step) for step in range(3)], "the Trainer's value, restored"
    assert all(e[1:3] == (0.5, None) for e in events[1::2]), "as Lightning passes them: algorithm unset"
    total = len(trainer.optimizers[0].param_groups[0]["params"])
    assert all(0 < e[3] < total for e in events[1::2]), "the optimizer holds the subnet's parameters only"


@pytest.mark.parametrize("namespace", NAMESPACES.values(), ids=NAMESPACES.keys())
def test_guard_the_private_lightning_api_clipping_relies_on(namespace: Any) -> None:
    """Precision._clip_gradients is where _after_closure clips (after on_before_optimizer_step); Lightning's
    validator refuses gradient_clip_val under manual optimization, before callbacks' setup runs. If either
    changes, clipping.py's hook and hide_from_validator must change with it."""
    import inspect

    precision = namespace.plugins.precision.Precision
    assert list(inspect.signature(precision._clip_gradients).parameters) == [
        "self", "model", "optimizer", "clip_val", "gradient_clip_algorithm"]
    after_closure = inspect.getsource(precision._after_closure)
    assert after_closure.index("on_before_optimizer_step") < after_closure.index("self._clip_gradients(")

    class Manual(namespace.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = nn.Linear(6, 3)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = namespace.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    with pytest.raises(Exception, match="Automatic gradient clipping is not supported for manual optimization"):
        trainer.fit(Manual(), toy_loader())


def test_which_runs_plan_a_norm_exchange() -> None:
    from lightning_naspipe.pipeline.exactness.clipping import _overrides_clipping, clips, clips_by_norm

    def module(value: Any, algorithm: Any) -> Any:
        return SimpleNamespace(trainer=SimpleNamespace(gradient_clip_val=value, gradient_clip_algorithm=algorithm))

    assert clips_by_norm(module(1.0, None)) and clips_by_norm(module(1.0, "norm"))
    assert not clips_by_norm(module(1.0, "value")) and not clips_by_norm(module(0.0, None))
    assert clips(module(1.0, "value")) and not clips(module(0.0, "value"))
    assert not clips_by_norm(module(None, None))
    pl = NAMESPACES["pytorch_lightning"]
    assert _overrides_clipping(_variant(pl, "Custom", configure_gradient_clipping=lambda *args: None))
    assert not _overrides_clipping(TOY_NETS[pl])


def test_the_async_baseline_sends_norm_messages_in_the_order_it_runs_its_updates() -> None:
    """``schedule="async"`` moves every update to the window's end: the links carry the norm messages there."""
    from lightning_naspipe.pipeline.runtime.window import Window
    from lightning_naspipe.pipeline.runtime.window_plan import plan_window
    from lightning_naspipe.schedule.actions import UPDATE
    from lightning_naspipe.schedule.rules import replay

    supernet = ToyBody().supernet
    window = Window(0, [uniform_architecture(supernet.labels, 1, i) for i in range(6)], [[(None, 1.0)]] * 6)
    plan = plan_window(supernet, window, [range(0, 2), range(2, 4), range(4, 5)], "async", 1, norms=True)
    run = plan.run_schedule()
    assert all([a.kind for a in order][-6:] == [UPDATE] * 6 for order in run.stages)
    replay(run, 3)
