"""Epoch schedules and checkpoints: exact resume, and checkpoints any Lightning user can load."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import lightning.pytorch
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import TOY_NETS, ToyNet, assert_same_state, full_state, toy_loader, train, trainer_kwargs


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
    assert sorted(plain.losses) == [10, 11, 12, 13]  # a fit from scratch would also end at 14, training 0..13



class ReadsAtEpochEnd(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


class StartsEpochs(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


class EpochEndModule(ToyNet):
    def on_train_epoch_end(self) -> None:
        pass


@pytest.mark.parametrize(("callbacks", "module_cls", "reads"), [
    ([], ToyNet, False),
    ([StartsEpochs(), pl.callbacks.EarlyStopping("loss"), pl.callbacks.ModelCheckpoint(),
      pl.callbacks.LearningRateMonitor(), pl.callbacks.TQDMProgressBar(), lnp.NASPipeCallback()], ToyNet, False),
    ([ReadsAtEpochEnd()], ToyNet, True),
    ([pl.callbacks.LambdaCallback(on_train_epoch_end=lambda *args: None)], ToyNet, True),
    ([], EpochEndModule, True),
])
def test_epoch_end_readers_are_any_callback_or_module_hook_but_lightnings_weight_blind_ones(
        callbacks: list[Any], module_cls: type, reads: bool) -> None:
    from lightning_naspipe.integration.callback import reads_weights_at_epoch_end

    trainer = pl.Trainer(callbacks=callbacks, logger=False)
    assert reads_weights_at_epoch_end(trainer, module_cls()) is reads


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
def test_an_epoch_end_sends_only_what_changed_and_only_when_something_reads_it(tmp_path: Path) -> None:
    """Two stages, epochs of 3 windows of a 4 x 12-candidate space: a callback reading the weights at each epoch's
    end sees the plain Trainer's, and the sync before it sent exactly the tensors that changed in the epoch (most
    candidates did not); with no reader nothing is sent."""
    import epoch_end_run
    from test_pipeline import run_ranks, torchrun_env

    run_ranks(tmp_path, Path(epoch_end_run.__file__), ["--out", str(tmp_path)], torchrun_env(2))
    piped = torch.load(tmp_path / "result", weights_only=False)
    plain = epoch_end_run.fit(1, reader=True)
    states, total = plain["states"], len(plain["final"])
    for before, after, seen, sent in zip(states, states[1:], piped[True]["states"][1:], piped[True]["sent"]):
        assert all(torch.equal(after[name], seen[name]) for name in after)
        changed = sum(not torch.equal(before[name], after[name]) for name in after)
        assert 0 < changed < total / 2 and sent == changed
    assert piped[False]["sent"] == [0, 0, 0]  # nothing read the weights: no epoch end sent any
    for run in (piped[True], piped[False]):
        assert all(torch.equal(plain["final"][name], run["final"][name]) for name in plain["final"])


# -- the space a checkpoint was trained on ------------------------------------------------------------------

#: What resuming ToyNet's checkpoint into the space with LNP_TEST_EXTRA_CANDIDATE=1 names.
EXTRA_CANDIDATE = ("choice 'block1' (blocks.1) had candidates [Sequential, Identity, Sequential] in the checkpoint, "
                   "now [Sequential, Identity, Sequential, Identity]")


def _checkpoint(tmp_path: Path, strategy: Any = None) -> Path:
    _, trainer = train(strategy, max_steps=4)
    ckpt = tmp_path / "four.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


class SkipsSuperOnLoad(ToyNet):
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # the habit: no super() call
        pass


@pytest.mark.parametrize("strategy, module_cls", [(None, ToyNet), ("naspipe", ToyNet), (None, SkipsSuperOnLoad)],
                         ids=["plain", "naspipe", "override-without-super"])
def test_resume_into_another_space_is_refused_before_training_naming_the_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str | None, module_cls: type) -> None:
    """One more parameter-free candidate: the same state dict's keys and shapes, which loaded silently."""
    ckpt = _checkpoint(tmp_path)
    assert torch.load(ckpt, weights_only=True)["naspipe"]["space"]["labels"][0] == ["block1", 3]
    monkeypatch.setenv("LNP_TEST_EXTRA_CANDIDATE", "1")
    model = module_cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = trainer_kwargs(max_steps=8) | ({"strategy": lnp.NASPipeStrategy(window=4)} if strategy else {})
    trainer = pl.Trainer(**kwargs)
    with pytest.raises(lnp.NASPipeConfigError) as error:
        trainer.fit(model, toy_loader(), ckpt_path=ckpt)
    assert str(error.value) == (
        f"The checkpoint {ckpt} was trained on another search space than {module_cls.__name__}'s supernet: "
        f"{EXTRA_CANDIDATE}. Resuming would train another space without a complaint (tensors of equal shapes load "
        "as they are, and every subnet sampled from here on differs). Resume with the space the checkpoint was "
        f"trained with; or, to train this space from its weights, start a new run: {module_cls.__name__}"
        ".load_from_checkpoint(path, strict=False), then trainer.fit(model) without ckpt_path (or start fresh).")
    assert trainer.global_step == 0 and not model.losses
    if module_cls is ToyNet:  # refused before the weights load; without super(), the callback refuses after
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_without_a_fingerprint_resumes_as_before(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint(tmp_path, lnp.NASPipeStrategy(window=4))
    raw = torch.load(ckpt, weights_only=False)
    del raw["naspipe"]["space"]  # as an earlier release wrote it
    torch.save(raw, ckpt)
    monkeypatch.setenv("LNP_TEST_EXTRA_CANDIDATE", "1")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=8, strategy=lnp.NASPipeStrategy(window=4)))
    model = ToyNet()
    trainer.fit(model, toy_loader(), ckpt_path=ckpt)
    assert trainer.global_step == 8
    assert sorted(model.losses) == [4, 5, 6, 7]  # resumed at 4: a fit from scratch would also end at 8


def test_validating_a_checkpoint_of_another_space_is_refused_unless_strict_loading_is_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``search`` loads its checkpoint through ``trainer.validate(ckpt_path=...)``: refused there too."""
    ckpt = _checkpoint(tmp_path)
    monkeypatch.setenv("LNP_TEST_EXTRA_CANDIDATE", "1")
    model = ToyNet()
    trainer = pl.Trainer(**trainer_kwargs(limit_val_batches=1))
    name = type(model).__name__
    with pytest.raises(lnp.NASPipeConfigError, match=re.escape(
            f"another search space than {name}'s supernet: {EXTRA_CANDIDATE}. Evaluate it with the space it was "
            f"trained with, or set strict_loading = False on {name} to load its weights into this space anyway.")):
        trainer.validate(model, toy_loader(samples=8), ckpt_path=ckpt, verbose=False)
    model.strict_loading = False
    trainer.validate(model, toy_loader(samples=8), ckpt_path=ckpt, verbose=False)
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    # load_from_checkpoint has no Trainer: its strict argument decides, as in Lightning.
    loaded = ToyNet.load_from_checkpoint(ckpt)
    assert len(loaded.supernet.blocks[1]) == 4


# -- Lightning's advice on checkpoints under manual optimization ------------------------------------------------

ADVICE = "Using ModelCheckpoint with manual optimization and every_n_train_steps"


class ManualBody:
    """A manual-optimization module without NASPipe: Lightning's advice is for it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1]))
        optimizer.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy, namespace", [(None, pl), ("naspipe", pl), ("naspipe", lightning.pytorch)],
                         ids=["plain", "naspipe", "naspipe-lightning.pytorch"])
def test_lightnings_advice_to_save_weights_before_the_step_is_not_shown_to_naspipe_runs_only(
        tmp_path: Path, strategy: str | None, namespace: Any) -> None:
    """A NASPipe checkpoint at step k holds the weights after subnet k's update, which is where a resume goes on."""
    def run(module: Any, **kwargs: Any) -> list[str]:
        folder = tmp_path / type(module).__name__
        checkpoint = namespace.callbacks.ModelCheckpoint(folder, every_n_train_steps=2, save_top_k=-1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            namespace.Trainer(**trainer_kwargs(max_steps=4, callbacks=[checkpoint], enable_checkpointing=True,
                                               **kwargs)).fit(module, toy_loader())
        assert len(list(folder.glob("*.ckpt"))) == 2
        return [str(w.message) for w in seen if ADVICE in str(w.message)]

    assert run(TOY_NETS[namespace](), **({"strategy": lnp.NASPipeStrategy(window=4)} if strategy else {})) == []
    # Only while a NASPipe run is set up: a module Lightning's advice is for still gets it after one.
    manual = type("ManualNet", (ManualBody, namespace.LightningModule), {})
    assert len(run(manual())) == 2  # once per checkpoint under "always"
