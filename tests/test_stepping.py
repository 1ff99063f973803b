"""``trainer.estimated_stepping_batches`` under ``NASPipeStrategy`` is the plain Trainer's, wherever it is read.

The full OneCycleLR fit against the plain run is a scenario of usage_scenarios.py (1 and 2 stages).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning
import torch

import lightning_naspipe as lnp
from helpers import TOY_NETS, pl, toy_loader, trainer_kwargs
from lightning_naspipe.integration.stepping import plain_estimate


class Stop(Exception):
    """Ends a fit once the estimates are read: training itself is not what these tests check."""


def _reading(namespace: Any) -> type:
    class Reads(TOY_NETS[namespace]):  # type: ignore[misc, valid-type]
        """Reads the estimate where users do: a setup hook, configure_optimizers, on_train_start."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, Any] = {}

        def setup(self, stage: str) -> None:
            self.seen["setup"] = self.trainer.estimated_stepping_batches

        def configure_optimizers(self) -> Any:
            self.seen["configure_optimizers"] = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

        def on_train_start(self) -> None:
            self.seen["on_train_start"] = self.trainer.estimated_stepping_batches
            raise Stop

    return Reads


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The toy batches without a length."""

    def __iter__(self) -> Any:
        return iter(toy_loader())


def _estimates(namespace: Any, strategy: Any, loader: Any = None, **flags: Any) -> tuple[dict[str, Any], type]:
    model = _reading(namespace)()
    kwargs = trainer_kwargs(**flags)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = namespace.Trainer(**kwargs)
    with pytest.raises(Stop):
        trainer.fit(model, loader if loader is not None else toy_loader())
    return model.seen, type(trainer)


@pytest.mark.parametrize("flags, expected", [
    (dict(max_epochs=2), 24),
    (dict(max_epochs=3, limit_train_batches=5), 15),
    (dict(max_epochs=2, limit_train_batches=0.5), 12),
    (dict(max_epochs=2, overfit_batches=2), 4),
    (dict(max_epochs=2, max_steps=10), 10),
    (dict(max_epochs=-1, max_steps=15), 15),
    (dict(max_epochs=None, max_steps=-1), 12000),  # Lightning's default of 1000 epochs
], ids=["max_epochs", "limit_train_batches-int", "limit_train_batches-fraction", "overfit_batches", "max_steps",
        "max_epochs=-1", "no-limits"])
def test_the_estimate_is_the_plain_runs_in_every_hook(flags: dict[str, Any], expected: int) -> None:
    plain, _ = _estimates(pl, None, **flags)
    windows, trainer_class = _estimates(pl, lnp.NASPipeStrategy(window=4), **flags)
    assert plain == windows == dict.fromkeys(["setup", "configure_optimizers", "on_train_start"], expected)
    assert trainer_class is pl.Trainer  # its own class again after the fit


def test_a_loader_without_length_gives_max_steps_as_plain() -> None:
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    plain, _ = _estimates(pl, None, loader=loader, max_epochs=2, max_steps=7)
    windows, _ = _estimates(pl, lnp.NASPipeStrategy(window=4), loader=loader, max_epochs=2, max_steps=7)
    assert plain == windows == dict.fromkeys(["setup", "configure_optimizers", "on_train_start"], 7)


@pytest.mark.parametrize("namespace", [pytest.param(L, id="lightning.pytorch"),
                                       pytest.param(pytorch_lightning, id="pytorch_lightning")])
def test_both_namespaces_and_a_trainer_subclass(namespace: Any) -> None:
    class MyTrainer(namespace.Trainer):  # type: ignore[misc, name-defined]
        pass

    model = _reading(namespace)()
    trainer = MyTrainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=5), max_epochs=3,
                                         limit_train_batches=7))
    with pytest.raises(Stop):
        trainer.fit(model, toy_loader())
    assert model.seen["configure_optimizers"] == 21
    assert type(trainer) is MyTrainer


def test_plain_estimate_follows_lightnings_rule() -> None:
    assert plain_estimate(12, 2, -1, 1) == 24
    assert plain_estimate(12, 2, 5, 1) == 5
    assert plain_estimate(float("inf"), 2, -1, 1) == -1
    assert plain_estimate(5, 0, -1, 1) == 5  # max_epochs=0 still counts one epoch, as Lightning's max(.., 1)
    assert plain_estimate(5, 2, -1, 2) == 6
