"""NASPipeStrategy on one device: bitwise equal to the plain sequential Trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import StrategyRegistry

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, full_state, toy_loader, train, trainer_kwargs


@pytest.fixture(scope="module")
def reference() -> dict:
    model, trainer = train(max_epochs=2)
    return full_state(model, trainer)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_naspipe_equals_plain_trainer_bitwise(reference: dict, window: int) -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=window), max_epochs=2)
    state = full_state(model, trainer)
    assert state["global_step"] == 24  # 96 samples / 8 per batch * 2 epochs, one subnet per batch
    assert len(state["losses"]) == 24
    assert_same_state(reference, state)


def test_strategy_by_name(reference: dict) -> None:
    model, trainer = train("naspipe", max_epochs=2)
    assert isinstance(trainer.strategy, lnp.NASPipeStrategy)
    assert_same_state(reference, full_state(model, trainer))


def test_equality_check_can_fail(reference: dict) -> None:
    # Another seed samples other subnets: the comparison must notice.
    model, trainer = train(lnp.NASPipeStrategy(window=4), seed=8, max_epochs=2)
    with pytest.raises(AssertionError):
        assert_same_state(reference, full_state(model, trainer))


def test_max_steps_counts_subnets_and_clamps_the_last_window() -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4), max_steps=10, max_epochs=5)
    assert trainer.global_step == 10
    assert sorted(model.losses) == list(range(10))


def test_registration_is_idempotent() -> None:
    from lightning_naspipe.integration.strategy import PytorchLightningNASPipeStrategy  # type: ignore[attr-defined]

    for _ in range(2):
        PytorchLightningNASPipeStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry["naspipe"]["strategy"] is PytorchLightningNASPipeStrategy


def test_more_stages_than_processes_are_refused_clearly() -> None:
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(num_stages=2), max_steps=1))
    with pytest.raises(lnp.NASPipeConfigError, match=r"num_stages must divide 1; use one of \[1\]"):
        trainer.fit(ToyNet(), toy_loader())


class InTwoChunks(ToyNet):  # type: ignore[misc, valid-type]
    chunks = 2


def test_chunks_split_each_subnet_batch() -> None:
    # NASPipeStrategy(chunks=2) on a module that sets no chunks equals the plain Trainer with the module's
    # chunks = 2 (each subnet's loss the weighted sum of two micro-batch losses), not the one-chunk plain run.
    model, trainer = train(lnp.NASPipeStrategy(window=4, chunks=2), max_steps=8)
    assert trainer.global_step == 8
    reference = full_state(*train(model_cls=InTwoChunks, max_steps=8))
    assert_same_state(reference, full_state(model, trainer))
    one_chunk, _ = train(max_steps=8)
    assert not all(torch.equal(v, one_chunk.state_dict()[k]) for k, v in model.state_dict().items()), "chunks mattered"


def test_distributed_sampler_is_refused() -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = toy_loader().dataset
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    trainer = pl.Trainer(**trainer_kwargs(strategy="naspipe", max_steps=2))
    with pytest.raises(lnp.NASPipeConfigError, match="same batches"):
        trainer.fit(ToyNet(), loader)


def test_validation_runs_the_evaluation_subnets() -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4), max_epochs=1, loader=toy_loader(),
                           val_loader=toy_loader(samples=16, shuffle=False))
    assert "val_loss" in trainer.callback_metrics
    architecture = model.eval_architecture(0)
    assert architecture == model.eval_architecture(0) and set(architecture) == set(model.supernet.labels)
    batch = next(iter(toy_loader(samples=16, shuffle=False)))
    model.eval()
    assert torch.equal(model.subnet_output(batch, architecture), model.supernet(batch[0], architecture))


def test_offload_equals_plain_and_reports_memory(reference: dict) -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4, offload=True), max_epochs=2)
    assert_same_state(reference, full_state(model, trainer))
    metrics = trainer.callback_metrics
    assert 0 < metrics["offload/peak_device_bytes_stage0"] <= metrics["offload/partition_bytes_stage0"] * 2
    assert metrics["offload/device_bytes_stage0"] == 0  # all back in host memory between windows


def test_checkpoint_every_n_train_steps_fires_at_the_plain_runs_steps(tmp_path: Path) -> None:
    # Windows of 5 over epochs of 12 subnets would land on 8, 16, ... only by chance; they end there instead.
    def fit(strategy: object, folder: str) -> dict[str, torch.Tensor]:
        every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=8, save_top_k=-1)
        train(strategy, max_epochs=3, enable_checkpointing=True, callbacks=[every])
        saved = sorted(p.name for p in (tmp_path / folder).iterdir())
        return {name: torch.load(tmp_path / folder / name, weights_only=False)["state_dict"] for name in saved}

    plain, piped = fit(None, "plain"), fit(lnp.NASPipeStrategy(window=5), "piped")
    assert list(plain) == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=1-step=24.ckpt",
                           "epoch=2-step=32.ckpt"]
    assert list(piped) == list(plain)
    for name in plain:
        assert all(torch.equal(plain[name][k], piped[name][k]) for k in plain[name]), name


def test_val_check_interval_in_batches_is_refused_with_windows() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=r"val_check_interval=3\) counts Lightning batches.*window=1"):
        train(lnp.NASPipeStrategy(window=4), max_epochs=1, val_check_interval=3,
              val_loader=toy_loader(samples=16, shuffle=False))
    train(lnp.NASPipeStrategy(window=1), max_epochs=1, val_check_interval=3,
          val_loader=toy_loader(samples=16, shuffle=False))  # one subnet per batch: exact, allowed


def test_weight_averaging_is_refused_under_the_strategy_and_kept_plain() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=r"EMAWeightAveraging \(a WeightAveraging callback\).*plain "
                                                     r"Trainer"):
        train(lnp.NASPipeStrategy(window=2), max_epochs=1, callbacks=[pl.callbacks.EMAWeightAveraging()])
    model, _ = train(None, max_epochs=1, callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.5)])
    assert model.global_step == 12  # the plain Trainer averages per subnet batch: allowed
