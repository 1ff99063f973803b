"""Lightning's learning-rate and batch-size finders: they work with the plain Trainer (the mixin's path) and are
refused under ``NASPipeStrategy`` before training, on every rank, naming the plain Trainer as the way to run them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import ToyNet, pl, toy_loader, trainer_kwargs

SCRIPT = Path(__file__).with_name("finder_run.py")
FINDERS = ["LearningRateFinder", "BatchSizeFinder", "lr_find", "scale_batch_size"]
REFUSAL = {"LearningRateFinder": r"LearningRateFinder \(the callback, or Tuner\(trainer\).lr_find, which adds it\) "
                                 r"cannot run under NASPipeStrategy.*plain Trainer first.*learning rate it found",
           "BatchSizeFinder": r"BatchSizeFinder \(the callback, or Tuner\(trainer\).scale_batch_size, which adds it\) "
                              r"cannot run under NASPipeStrategy.*plain Trainer first.*batch size it found"}
REFUSAL.update(lr_find=REFUSAL["LearningRateFinder"], scale_batch_size=REFUSAL["BatchSizeFinder"])


class SizedNet(ToyNet):  # type: ignore[misc, valid-type]
    """ToyNet whose loaders follow ``self.batch_size``, as the batch-size finder needs."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self) -> Any:
        return toy_loader(batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        return toy_loader(samples=16, batch_size=self.batch_size)


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_lr_find_works_with_the_plain_trainer_and_leaves_the_weights_as_they_were() -> None:
    pl.seed_everything(7, verbose=False)
    model = ToyNet()
    before = _weights(model)
    finder = pl.tuner.Tuner(pl.Trainer(**trainer_kwargs(max_epochs=3))).lr_find(
        model, toy_loader(), num_training=20, early_stop_threshold=None)
    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert len(lrs) == len(losses) == 20 and lrs == sorted(lrs) and lrs[0] < lrs[-1]
    assert all(loss == loss for loss in losses)  # every subnet step logged a loss (a NaN marks a missing one)
    assert finder.suggestion() is not None
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the finder's steps were thrown away


def test_the_learning_rate_finder_callback_then_trains_with_its_suggestion() -> None:
    pl.seed_everything(7, verbose=False)
    model, callback = ToyNet(), pl.callbacks.LearningRateFinder(num_training_steps=20, update_attr=True)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2, callbacks=[callback]))
    trainer.fit(model, toy_loader())
    assert callback.optimal_lr is not None and model.lr == callback.optimal_lr.suggestion() != 0.05
    assert trainer.global_step == 24 and trainer.optimizers[0].param_groups[0]["lr"] != 0.05


def test_scale_batch_size_works_with_the_plain_trainer() -> None:
    model = SizedNet()
    found = pl.tuner.Tuner(pl.Trainer(**trainer_kwargs(max_epochs=1))).scale_batch_size(model, max_trials=3)
    assert found == model.batch_size == 8  # 2 -> 4 -> 8, the last of 3 trials


@pytest.mark.parametrize("finder", FINDERS)
def test_finders_are_refused_under_the_strategy_before_training(finder: str) -> None:
    model = SizedNet()
    callbacks = [getattr(pl.callbacks, finder)()] if finder[0].isupper() else []
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=4), callbacks=callbacks, max_epochs=1))
    with pytest.raises(lnp.NASPipeConfigError, match=REFUSAL[finder]):
        if callbacks:
            trainer.fit(model)
        else:
            getattr(pl.tuner.Tuner(trainer), finder)(model)
    assert trainer.global_step == 0 and not list(Path.cwd().glob(".lr_find_*.ckpt"))


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
@pytest.mark.parametrize("finder", ["BatchSizeFinder"])  # lr_find is refused by the same check (in process above)
def test_every_stage_refuses_a_finder_promptly(tmp_path: Path, finder: str) -> None:
    # finder_run's stage timeout (600 s) outlasts the hang protection (120 s): a stage that waited fails the test.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--finder", finder, "--devices", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode != 0
    # Both stage processes (the launcher's child writes to the same stderr) name the finder and the fix, and
    # nothing else failed: no lost connection, no missing checkpoint file.
    assert len(re.findall(f"NASPipeConfigError: {REFUSAL[finder]}", proc.stderr)) == 2, proc.stderr[-3000:]
    for symptom in ("onnection closed", "FileNotFoundError", "Pipeline stage"):
        assert symptom not in proc.stderr
    assert not list(tmp_path.glob(".*.ckpt"))
