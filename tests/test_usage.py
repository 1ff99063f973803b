"""Lightning habits against the plain Trainer: batch limits, every resume point, and clear refusals.

The in-process half of the compatibility matrix (docs/lightning.md): ``NASPipeStrategy`` on one stage
runs windows of subnets exactly as several stages do, so every flag that counts batches and every
resume point is checked here against a plain one-device Trainer, bitwise; test_usage_stages.py runs the
habits that depend on several stage processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, full_state, pl, toy_loader, train, trainer_kwargs
from lightning_naspipe.errors import NASPipeConfigError


class Recorder(pl.loggers.Logger):  # type: ignore[misc]
    """Keeps every logged point, to compare a run's metrics with the plain run's."""

    name, version = "recorder", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoaderCrash(Exception):
    """What CrashingLoader raises."""


class CrashingLoader:
    """A training loader that raises when it is read for its ``at``-th batch (counted over epochs)."""

    def __init__(self, at: int) -> None:
        self.loader, self.at, self.read = toy_loader(), at, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            if self.read == self.at:
                raise LoaderCrash(f"the data source failed at batch {self.at}")
            self.read += 1
            yield batch


def _fit(strategy: Any = None, loader: Any = None, ckpt_path: Any = None, callbacks: tuple[Any, ...] = (),
         **overrides: Any) -> dict[str, Any]:
    """Fit ToyNet with validation and a Recorder; its full state and logged rows (a loader crash is caught)."""
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    model, logger = ToyNet(), Recorder()
    kwargs = trainer_kwargs(logger=logger, log_every_n_steps=1, callbacks=list(callbacks), **overrides)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = pl.Trainer(**kwargs)
    try:
        trainer.fit(model, loader if loader is not None else toy_loader(), toy_loader(samples=16, shuffle=False),
                    ckpt_path=ckpt_path)
    except LoaderCrash:
        pass
    return {**full_state(model, trainer), "rows": logger.rows}


def _same_as(reference: dict[str, Any], run: dict[str, Any], from_step: int = 0, validated: bool = True) -> None:
    """``run`` (perhaps resumed at ``from_step``) ends bitwise where ``reference`` does, with the same
    per-subnet losses and validation points from ``from_step`` on (and the one at ``from_step - 1``, the
    last subnet's, unless it was ``validated`` before the checkpoint)."""
    expected = {**reference, "losses": {k: v for k, v in reference["losses"].items() if k >= from_step}}
    assert_same_state(expected, run)
    first = from_step if validated else from_step - 1

    def validation(rows: list[Any]) -> list[Any]:
        return [row for row in rows if "val_loss" in row[1] and row[0] >= first]

    assert validation(run["rows"]) == validation(reference["rows"]) != []


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    return _fit(max_epochs=3)


@pytest.mark.parametrize("flags", [dict(limit_train_batches=5), dict(limit_train_batches=0.5),
                                   dict(overfit_batches=2), dict(reload_dataloaders_every_n_epochs=1)],
                         ids=["limit-int", "limit-fraction", "overfit", "reload-dataloaders"])
def test_flags_that_count_batches_or_read_data_give_the_plain_result(flags: dict[str, Any]) -> None:
    assert_same_state(_fit(max_epochs=3, **flags), _fit(lnp.NASPipeStrategy(window=4), max_epochs=3, **flags))


def _every_12_steps(folder: Path) -> Any:
    return pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=12, save_top_k=-1, filename="{step}")


# (callback making the checkpoint, loader, file, subnets trained before it, whether the epoch before it had
# validated). An epoch has 12 batches; a checkpoint in an epoch's last window comes before its validation.
RESUME_POINTS = {
    "epoch's last window": (_every_12_steps, None, "step=12.ckpt", 12, False),
    "another epoch's last window": (_every_12_steps, None, "step=24.ckpt", 24, False),
    "exception at an epoch's first window": (pl.callbacks.OnExceptionCheckpoint, lambda: CrashingLoader(14),
                                             "on_exception.ckpt", 12, True),
    "exception mid-epoch": (pl.callbacks.OnExceptionCheckpoint, lambda: CrashingLoader(21), "on_exception.ckpt",
                            16, True),
    "last.ckpt after a loader crash": (lambda folder: pl.callbacks.ModelCheckpoint(dirpath=folder, save_last=True),
                                       lambda: CrashingLoader(14), "last.ckpt", 12, True),
}


@pytest.mark.parametrize("point", list(RESUME_POINTS))
def test_every_resume_point_continues_bitwise(tmp_path: Path, plain: dict[str, Any], point: str) -> None:
    callback, loader, name, step, validated = RESUME_POINTS[point]
    _fit(lnp.NASPipeStrategy(window=4), loader() if loader else None, callbacks=(callback(tmp_path),),
         enable_checkpointing=True, max_epochs=3)
    assert torch.load(tmp_path / name, weights_only=False)["global_step"] == step
    resumed = _fit(lnp.NASPipeStrategy(window=3), ckpt_path=tmp_path / name, max_epochs=3)
    _same_as(plain, resumed, from_step=step, validated=validated)


@pytest.mark.parametrize("flags, match", [
    (dict(val_check_interval=0.5), r"val_check_interval=0.5.*window=1"),
    (dict(callbacks=[pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)]),
     r"StochasticWeightAveraging is not supported.*fine-tuning the exported subnet"),
], ids=["val_check_interval-fraction", "stochastic-weight-averaging"])
def test_flags_that_cannot_be_exact_are_refused_before_training(flags: dict[str, Any], match: str) -> None:
    with pytest.raises(NASPipeConfigError, match=match):
        _fit(lnp.NASPipeStrategy(window=4), max_epochs=1, **flags)


def test_a_fraction_of_a_loader_without_length_is_refused_naming_the_fix() -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(toy_loader().dataset)

    with pytest.raises(NASPipeConfigError, match=r"limit_train_batches=0.5.*no length.*number of batches"):
        _fit(lnp.NASPipeStrategy(window=4), loader=torch.utils.data.DataLoader(Stream(), batch_size=8),
             max_epochs=1, limit_train_batches=0.5)


class PlateauNet(ToyNet):  # type: ignore[misc, valid-type]
    """Lightning's usual ReduceLROnPlateau config: the monitor beside the scheduler."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "epoch"},
                "monitor": "val_loss"}


def test_reduce_lr_on_plateau_monitoring_val_loss_steps_as_in_the_plain_run() -> None:
    def fit(strategy: Any) -> tuple[dict[str, Any], float]:
        pl.seed_everything(7, verbose=False)
        model = PlateauNet()
        trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, max_epochs=3) if strategy else trainer_kwargs(
            max_epochs=3))
        trainer.fit(model, toy_loader(), toy_loader(samples=16, shuffle=False))
        return full_state(model, trainer), trainer.optimizers[0].param_groups[0]["lr"]

    (plain, plain_lr), (piped, piped_lr) = fit(None), fit(lnp.NASPipeStrategy(window=4))
    assert_same_state(plain, piped)
    assert plain_lr == piped_lr < 0.05  # the plateau scheduler did reduce it


def test_a_module_that_writes_its_own_training_step_is_refused_naming_compute_loss() -> None:
    class OwnStep(ToyNet):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.compute_loss(self.supernet(batch[0], self.sample_subnet(batch_idx)), batch)

    with pytest.raises(NASPipeConfigError, match=r"overrides training_step.*compute_loss"):
        pl.Trainer(**trainer_kwargs(max_epochs=1)).fit(OwnStep(), toy_loader())


def test_barebones_trains_as_the_plain_run_and_logs_nothing() -> None:
    flags = dict(barebones=True, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, max_epochs=2)
    plain_model, plain_trainer = train(**flags)
    model, trainer = train(lnp.NASPipeStrategy(window=4), **flags)
    assert_same_state(full_state(plain_model, plain_trainer), full_state(model, trainer))
