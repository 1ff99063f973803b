"""Epoch schedules and checkpoints: exact resume, and checkpoints any Lightning user can load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, full_state, toy_loader, train, trainer_kwargs


class EpochScheduled(ToyNet):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def test_epoch_scheduler_steps_once_per_epoch_in_both_paths() -> None:
    plain, plain_trainer = train(model_cls=EpochScheduled, max_epochs=3)
    assert plain_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)
    piped, piped_trainer = train(lnp.NASPipeStrategy(window=5), model_cls=EpochScheduled, max_epochs=3)
    assert_same_state(full_state(plain, plain_trainer), full_state(piped, piped_trainer))


class SaveAt(pl.Callback):
    """Saves a checkpoint at the end of one training batch or one epoch."""

    def __init__(self, path: Path, epoch: int, batch_idx: int | None) -> None:
        self.path, self.epoch, self.batch_idx = path, epoch, batch_idx

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.current_epoch == self.epoch and args[-1] == self.batch_idx:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch and self.batch_idx is None:
            trainer.save_checkpoint(self.path)


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    model, trainer = train(lnp.NASPipeStrategy(window=4), max_epochs=3)
    return full_state(model, trainer)


def _resume(ckpt: Path, window: int, losses: dict) -> dict:
    pl.seed_everything(1234, verbose=False)  # another seed and RNG state than the first run
    model = ToyNet()
    model.losses.update({k: v for k, v in losses.items() if k < torch.load(ckpt, weights_only=False)["global_step"]})
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=window), max_epochs=3))
    trainer.fit(model, toy_loader(), ckpt_path=ckpt)
    return full_state(model, trainer)


@pytest.mark.parametrize("stop_kwargs, resume_window", [
    ({"max_steps": 10}, 4),           # max_steps stops inside a window, inside an epoch
    ({"max_steps": 10}, 3),           # ... resumed with another window
    ({"max_steps": 12}, 4),           # stops exactly at the epoch's end
    ({"epoch": 1, "batch_idx": 1}, 4),  # saved at a batch end mid-epoch
    ({"epoch": 0, "batch_idx": None}, 6),  # saved at an epoch end
])
def test_resume_is_exact(tmp_path: Path, uninterrupted: dict, stop_kwargs: dict, resume_window: int) -> None:
    ckpt = tmp_path / "stop.ckpt"
    if "max_steps" in stop_kwargs:
        model, trainer = train(lnp.NASPipeStrategy(window=4), max_epochs=3, **stop_kwargs)
        trainer.save_checkpoint(ckpt)
    else:
        model, trainer = train(lnp.NASPipeStrategy(window=4), max_epochs=3, callbacks=[SaveAt(ckpt, **stop_kwargs)])
    assert_same_state(uninterrupted, _resume(ckpt, resume_window, model.losses))


def test_checkpoint_is_a_normal_lightning_checkpoint(tmp_path: Path) -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4), max_steps=10)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)

    loaded = ToyNet.load_from_checkpoint(ckpt)
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name])
    raw = torch.load(ckpt, weights_only=False)
    assert raw["global_step"] == 10 and len(raw["optimizer_states"]) == 1

    # A plain Trainer (no strategy) resumes from it.
    plain = ToyNet()
    plain_trainer = pl.Trainer(**trainer_kwargs(max_steps=14))
    plain_trainer.fit(plain, toy_loader(), ckpt_path=ckpt)
    assert plain_trainer.global_step == 14
