from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, pl
from lightning_naspipe.integration.batch_hooks import call_per_subnet_batch
from lightning_naspipe.integration.data import DataTracker
from usage_scenarios import SkipsRestOfEpoch, fit


def test_a_module_without_the_hook_is_left_alone() -> None:
    model = ToyNet()
    call_per_subnet_batch(model, DataTracker(lambda: None))
    assert "on_train_batch_start" not in model.__dict__


def test_an_epoch_ended_by_the_hook_resumes_into_the_next_epoch(tmp_path: Path) -> None:
    # Each epoch ends after 5 batches: inside the second window of 4. A checkpoint at that epoch's end
    # must resume with the next epoch, not with the rest of the cut one.
    plain = fit(lambda: None, max_epochs=3, model_class=SkipsRestOfEpoch)
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(lambda: lnp.NASPipeStrategy(window=4), max_epochs=1, model_class=SkipsRestOfEpoch, callbacks=(saving,),
        enable_checkpointing=True)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 5
    resumed = fit(lambda: lnp.NASPipeStrategy(window=3), max_epochs=3, model_class=SkipsRestOfEpoch,
                  ckpt_path=tmp_path / "last.ckpt")
    assert_same_state({**plain, "losses": {k: v for k, v in plain["losses"].items() if k >= 5}}, resumed)


def test_a_metric_object_logged_in_on_train_batch_start_is_refused_naming_the_fix() -> None:
    import torchmetrics

    class LogsAMetric(ToyNet):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.seen = torchmetrics.MeanMetric()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.seen.update(batch[0].mean())
            self.log("seen", self.seen)

    with pytest.raises(lnp.NASPipeConfigError, match=r"self.log\('seen', <MeanMetric>\) in on_train_batch_start "
                                                     r"during training.*tensors and numbers only.*Log the value"):
        fit(lambda: lnp.NASPipeStrategy(window=4), max_epochs=1, model_class=LogsAMetric)


def test_the_hook_is_not_shown_batches_past_max_steps() -> None:
    class Counts(ToyNet):  # type: ignore[misc, valid-type]
        shown: list[int] = []

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            Counts.shown.append(batch_idx)

    fit(lambda: lnp.NASPipeStrategy(window=4), max_epochs=-1, max_steps=6, model_class=Counts)
    assert Counts.shown == list(range(6))  # as a plain run: the window of 4..7 is cut at max_steps
