from __future__ import annotations

from pathlib import Path

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
