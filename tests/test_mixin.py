"""Bad configurations fail early with a NASPipeConfigError that names the problem and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_naspipe as lnp
from helpers import ToyNet, toy_loader, trainer_kwargs


def _fit(model: pl.LightningModule, strategy: Any = None, **overrides: Any) -> pl.Trainer:
    kwargs = trainer_kwargs(**{"max_steps": 2, **overrides})
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, toy_loader())
    return trainer


class NoMixin(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoSupernet(lnp.NASPipeMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AutoOpt(ToyNet):
    @property
    def automatic_optimization(self) -> bool:
        return True


class TwoOptimizers(ToyNet):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)


class NoLoss(lnp.NASPipeMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(nn.Linear(6, 3))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ExtraParameters(ToyNet):
    def __init__(self) -> None:
        super().__init__()
        self.outside = nn.Linear(2, 2)


def test_module_without_mixin_is_refused_by_the_strategy() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="NASPipeMixin"):
        _fit(NoMixin(), "naspipe")


@pytest.mark.parametrize("strategy", [None, "naspipe"])
def test_module_without_supernet(strategy: str | None) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="self.supernet = "):
        _fit(NoSupernet(), strategy)


@pytest.mark.parametrize("strategy", [None, "naspipe"])
def test_gradient_accumulation_is_refused_with_advice(strategy: str | None) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="larger batch_size"):
        _fit(ToyNet(), strategy, accumulate_grad_batches=2)


def test_setting_automatic_optimization_is_refused() -> None:
    model = ToyNet()
    model.automatic_optimization = False  # harmless
    with pytest.raises(lnp.NASPipeConfigError, match="manual optimization"):
        model.automatic_optimization = True


@pytest.mark.parametrize("strategy", [None, "naspipe"])
def test_overriding_automatic_optimization_is_refused(strategy: str | None) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="automatic optimization"):
        _fit(AutoOpt(), strategy)


def test_more_than_one_optimizer_is_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="exactly one"):
        _fit(TwoOptimizers(), "naspipe")


def test_parameters_outside_the_supernet_are_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="outside self.supernet"):
        _fit(ExtraParameters())


def test_missing_compute_loss_is_named() -> None:
    with pytest.raises(NotImplementedError, match="compute_loss"):
        _fit(NoLoss(), "naspipe")


def test_on_train_subnet_end_sees_every_subnet_in_order() -> None:
    model = ToyNet()
    _fit(model, lnp.NASPipeStrategy(window=3), max_steps=7)
    assert list(model.losses) == list(range(7))


def test_seed_comes_from_seed_everything_or_the_attribute() -> None:
    pl.seed_everything(31, verbose=False)
    model = ToyNet()
    assert model.naspipe_seed == 31
    model.naspipe_seed = 5
    assert model.naspipe_seed == 5


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
def test_another_multi_process_strategy_is_refused_naming_naspipe() -> None:
    # DDP's own advice (find_unused_parameters) would make it train something else silently.
    trainer = pl.Trainer(**trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=2))
    with pytest.raises(Exception, match=r"NASPipe mixin under DDPStrategy with 2 processes.*strategy=\"naspipe\""):
        trainer.fit(ToyNet(), toy_loader())


def test_configure_callbacks_without_super_is_named() -> None:
    class NoCallbacks(ToyNet):  # type: ignore[misc, valid-type]
        def configure_callbacks(self) -> list[Any]:
            return []

    for strategy in (None, lnp.NASPipeStrategy(window=2)):
        trainer = pl.Trainer(**trainer_kwargs(strategy=strategy or "auto", max_steps=2))
        with pytest.raises(lnp.NASPipeConfigError, match=r"return super\(\).configure_callbacks\(\)"):
            trainer.fit(NoCallbacks(), toy_loader())


class ExplodingLoss(ToyNet):  # type: ignore[misc, valid-type]
    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        loss = super().compute_loss(output, batch)
        return loss * float("nan") if self.trainer.global_step >= 5 else loss


@pytest.mark.parametrize("strategy", [None, "naspipe"])
def test_nonfinite_loss_stops_naming_the_subnet_unless_allowed(strategy: str | None) -> None:
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy or "auto", max_steps=12))
    with pytest.raises(FloatingPointError, match=r"Subnet \d+ \(architecture \{.*\}\) has a non-finite training "
                                                 r"loss \(nan\)"):
        trainer.fit(ExplodingLoss(), toy_loader())
    model = ExplodingLoss()
    model.naspipe_allow_nonfinite_loss = True
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy or "auto", max_steps=12))
    trainer.fit(model, toy_loader())
    assert trainer.global_step == 12


def test_predict_runs_the_evaluation_subnet() -> None:
    model = ToyNet()
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=2)))
    outputs = trainer.predict(model, toy_loader(samples=16, shuffle=False))
    batch = next(iter(toy_loader(samples=16, shuffle=False)))
    model.eval()
    with torch.no_grad():
        expected = model.supernet(batch[0], model.eval_architecture(0))
    assert len(outputs) == 2 and torch.equal(outputs[0], expected)


class InTwoChunks(ToyNet):
    chunks = 2


def test_chunks_on_the_module_split_the_plain_trainers_batches_as_the_strategy_does() -> None:
    """The micro-batch count is the module's: the plain Trainer trains it, and NASPipeStrategy() follows it."""
    from helpers import assert_same_state, train

    def state(model: Any, trainer: Any) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                "losses": model.losses, "global_step": trainer.global_step}

    plain = state(*train(None, model_cls=InTwoChunks, max_steps=6))
    followed, trainer = train(lnp.NASPipeStrategy(), model_cls=InTwoChunks, max_steps=6)
    assert trainer.strategy.chunks == 2
    assert_same_state(plain, state(followed, trainer))
    one_chunk = state(*train(None, max_steps=6))
    assert not all(torch.equal(v, one_chunk["model"][k]) for k, v in plain["model"].items()), "chunks mattered"


def test_a_strategy_chunks_unlike_the_modules_is_refused_naming_both() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=r"NASPipeStrategy\(chunks=4\) differs from InTwoChunks.chunks = 2"
                       r".*Leave NASPipeStrategy's chunks unset"):
        _fit(InTwoChunks(), lnp.NASPipeStrategy(chunks=4))


def test_a_strategy_chunks_with_a_module_that_sets_none_is_used_and_logged() -> None:
    """Kept working as before the module owned chunks; the run's log (rank-zero info) names the plain run it equals."""
    strategy, logged = lnp.NASPipeStrategy(chunks=2), []
    strategy._info = logged.append  # type: ignore[method-assign]
    trainer = _fit(ToyNet(), strategy)
    assert trainer.strategy.chunks == 2
    assert any("equals the plain Trainer with" in line and "ToyNet.chunks = 2" in line for line in logged), logged


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_bad_module_chunks_is_named(value: object) -> None:
    model = ToyNet()
    model.chunks = value  # type: ignore[assignment]
    with pytest.raises(lnp.NASPipeConfigError, match=r"ToyNet.chunks is .*positive int"):
        _fit(model)
