"""Both Lightning namespaces, ``lightning.pytorch`` and ``pytorch_lightning``, in one process.

The multi-process halves (2 stages under ``lightning.pytorch``, their checkpoint resumed under
``pytorch_lightning`` on 1 stage) are in test_pipeline.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import TOY_NETS, assert_same_state, full_state, toy_loader, train
from lightning_naspipe.namespaces import installed, namespace_of
from lightning_naspipe.integration.strategy import LightningNASPipeStrategy, PytorchLightningNASPipeStrategy  # type: ignore

BOTH = [pytest.param(L, id="lightning.pytorch"), pytest.param(pl, id="pytorch_lightning")]
BOUND = {L: LightningNASPipeStrategy, pl: PytorchLightningNASPipeStrategy}


def test_namespace_of_tells_the_two_apart() -> None:
    assert [ns.name for ns in installed()] == ["lightning.pytorch", "pytorch_lightning"]
    assert namespace_of(TOY_NETS[L]).name == "lightning.pytorch"
    assert namespace_of(TOY_NETS[pl]()).name == "pytorch_lightning"
    assert namespace_of(pl.accelerators.CPUAccelerator()).name == "pytorch_lightning"
    assert namespace_of(L.plugins.TorchCheckpointIO()).name == "lightning.pytorch"  # lightning.fabric's class
    assert namespace_of(torch.nn.Linear(1, 1)) is None


@pytest.mark.parametrize("namespace", BOTH)
@pytest.mark.parametrize("how", ["name", "instance"])
def test_each_trainer_takes_the_strategy_bound_to_its_namespace(namespace: Any, how: str) -> None:
    strategy = "naspipe" if how == "name" else lnp.NASPipeStrategy(window=3)
    trainer = namespace.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is BOUND[namespace]
    assert isinstance(trainer.strategy, lnp.NASPipeStrategy)
    assert isinstance(trainer.strategy, namespace.strategies.ParallelStrategy)
    launcher = trainer.strategy.launcher
    assert launcher is None or type(launcher).__module__.startswith(namespace.__name__)
    if how == "instance":
        assert trainer.strategy is strategy and trainer.strategy.window == 3


def test_a_plugin_binds_the_strategy_and_the_other_namespace_is_refused() -> None:
    strategy = lnp.NASPipeStrategy(checkpoint_io=pl.plugins.TorchCheckpointIO())
    assert type(strategy) is PytorchLightningNASPipeStrategy
    with pytest.raises(lnp.NASPipeConfigError, match="belongs to pytorch_lightning.*do not mix"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    with pytest.raises(lnp.NASPipeConfigError, match="belongs to lightning.pytorch.*cannot serve pytorch_lightning"):
        lnp.NASPipeStrategy(checkpoint_io=pl.plugins.TorchCheckpointIO(), accelerator=L.accelerators.CPUAccelerator())


def test_callback_and_error_are_both_namespaces_types() -> None:
    assert isinstance(lnp.NASPipeCallback(), L.Callback) and isinstance(lnp.NASPipeCallback(), pl.Callback)
    for fabric in ("lightning.fabric", "lightning_fabric"):
        exceptions = __import__(f"{fabric}.utilities.exceptions", fromlist=["MisconfigurationException"])
        assert issubclass(lnp.NASPipeConfigError, exceptions.MisconfigurationException)


@pytest.mark.parametrize("namespace", BOTH)
def test_strategy_equals_plain_under_each_namespace(namespace: Any) -> None:
    # The plain run is the same under both namespaces, and the window path equals it in each.
    reference = full_state(*train(namespace=pl, max_epochs=1))
    assert_same_state(reference, full_state(*train(namespace=namespace, max_epochs=1)))
    pipelined = full_state(*train(lnp.NASPipeStrategy(window=5), namespace=namespace, max_epochs=1))
    assert_same_state(reference, pipelined)


@pytest.mark.parametrize("first, second", [pytest.param(pl, L, id="pytorch_lightning-to-lightning.pytorch"),
                                           pytest.param(L, pl, id="lightning.pytorch-to-pytorch_lightning")])
def test_checkpoint_written_under_one_namespace_resumes_under_the_other(tmp_path: Path, first: Any,
                                                                       second: Any) -> None:
    uninterrupted = full_state(*train(lnp.NASPipeStrategy(window=4), namespace=second, max_epochs=2))
    _, stopped = train(lnp.NASPipeStrategy(window=4), namespace=first, max_epochs=2, max_steps=9)
    ckpt = tmp_path / "stop.ckpt"
    stopped.save_checkpoint(ckpt)
    losses = stopped.lightning_module.losses
    torch.set_num_threads(1)
    # Another seed than the uninterrupted run's: a fit that ignored the checkpoint would end elsewhere.
    second.seed_everything(1234, verbose=False)
    model = TOY_NETS[second]()
    model.losses.update(losses)
    trainer = second.Trainer(strategy=lnp.NASPipeStrategy(window=3), accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             max_epochs=2)
    trainer.fit(model, toy_loader(), ckpt_path=ckpt)
    assert_same_state(uninterrupted, full_state(model, trainer))


@pytest.mark.parametrize("namespace", BOTH)
def test_lightning_cli_of_each_namespace_trains_with_naspipe(namespace: Any, tmp_path: Path) -> None:
    cli_module = importlib.import_module(f"{namespace.__name__}.cli")

    class Data(namespace.LightningDataModule):  # type: ignore[name-defined, misc]
        def train_dataloader(self) -> Any:
            return toy_loader()

    cli = cli_module.LightningCLI(
        TOY_NETS[namespace], Data, run=False, seed_everything_default=7,
        args=["--trainer.strategy=lightning_naspipe.NASPipeStrategy", "--trainer.strategy.window=4",
              "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=6", "--trainer.logger=false",
              "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={tmp_path}"],
    )
    assert type(cli.trainer.strategy) is BOUND[namespace] and cli.trainer.strategy.window == 4
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 6
