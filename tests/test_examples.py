"""The digits SPOS example: it learns, logs through a Lightning logger, and runs from LightningCLI."""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_naspipe as lnp
from helpers import EXAMPLES, QUIET, load_example

torch.set_num_threads(1)  # the conftest fixture pins it per test too; this covers module-level work

@pytest.fixture(scope="module")
def digits() -> ModuleType:
    return load_example("digits_spos")


@pytest.fixture
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when both ``args`` and pytest's own sys.argv are present.
    monkeypatch.setattr(sys, "argv", ["digits_spos.py"])


def _fit(
    digits: ModuleType, tmp_path: Path, strategy: Any, **trainer_kwargs: Any
) -> tuple[pl.LightningModule, pl.Trainer]:
    pl.seed_everything(42, verbose=False)
    model, datamodule = digits.DigitsSupernet(), digits.DigitsDataModule()
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=1, strategy=strategy, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, logger=False,
                                  default_root_dir=tmp_path)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, datamodule)
    return model, trainer


def _read_metrics(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_example_learns_and_logs(digits: ModuleType, tmp_path: Path) -> None:
    # 10 epochs of 23 batches (about 2.5 s on an idle core) reach val_acc ~0.65; chance is 0.1.
    logger = CSVLogger(tmp_path, name="digits")
    model, trainer = _fit(digits, tmp_path, "naspipe", max_steps=230, logger=logger, log_every_n_steps=1)
    assert trainer.global_step == 230
    assert isinstance(trainer.strategy, lnp.NASPipeStrategy)
    assert float(trainer.callback_metrics["val_acc"]) > 0.4

    rows = _read_metrics(logger.experiment.metrics_file_path)
    train_losses = [float(r["train_loss_step"]) for r in rows if r.get("train_loss_step")]
    val_accs = [float(r["val_acc"]) for r in rows if r.get("val_acc")]
    assert train_losses and all(torch.isfinite(torch.tensor(train_losses)))
    assert any(r.get("train_loss_epoch") for r in rows)
    assert len(val_accs) == 10  # one validation per epoch
    assert val_accs[-1] == pytest.approx(float(trainer.callback_metrics["val_acc"]))
    assert val_accs[-1] > val_accs[0]
    assert all(f"val_acc_subnet{i}" in rows[0] for i in range(model.hparams["num_val_subnets"]))


def test_example_naspipe_matches_plain_trainer(digits: ModuleType, tmp_path: Path) -> None:
    # NASPipe's contract on the real example: the pipeline trains exactly what the plain Trainer does.
    plain, _ = _fit(digits, tmp_path, "auto", max_steps=20, limit_val_batches=0)
    piped, _ = _fit(digits, tmp_path, lnp.NASPipeStrategy(window=4), max_steps=20, limit_val_batches=0)
    expected, actual = plain.state_dict(), piped.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_val_panel_is_fixed(digits: ModuleType) -> None:
    model = digits.DigitsSupernet()
    model.naspipe_seed = 42
    panel = model.val_architectures()
    assert len(panel) == model.num_val_subnets
    assert panel == model.val_architectures()
    assert all(model.supernet.validate(architecture) == architecture for architecture in panel)


@pytest.mark.usefixtures("clean_argv")
def test_cli_strategy_by_name(digits: ModuleType, tmp_path: Path) -> None:
    cli = digits.cli_main(["fit", "--trainer.strategy", "naspipe", "--trainer.max_steps", "6",
                           "--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu",
                           "--trainer.devices", "1", *QUIET])
    assert isinstance(cli.trainer.strategy, lnp.NASPipeStrategy)
    assert cli.trainer.strategy.window == 8  # the default
    assert cli.trainer.global_step == 6
    assert (tmp_path / "config.yaml").is_file()  # LightningCLI saved the run's config


@pytest.mark.usefixtures("clean_argv")
def test_cli_yaml_class_path_strategy(digits: ModuleType, tmp_path: Path) -> None:
    config = tmp_path / "naspipe.yaml"
    config.write_text(
        "seed_everything: 3\n"
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  max_steps: 6\n"
        "  strategy:\n"
        "    class_path: lightning_naspipe.NASPipeStrategy\n"
        "    init_args:\n"
        "      window: 4\n"
        "      chunks: 2\n"
        "model:\n"
        "  channels: 8\n"
        "data:\n"
        "  batch_size: 32\n"
    )
    cli = digits.cli_main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path), *QUIET])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lnp.NASPipeStrategy)
    assert (strategy.window, strategy.chunks) == (4, 2)
    assert cli.model.hparams["channels"] == 8 and cli.datamodule.batch_size == 32
    assert cli.trainer.global_step == 6


@pytest.mark.usefixtures("clean_argv")
def test_cli_shipped_config(digits: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The config in examples/ parses and runs; only the run length is cut short, and it runs in
    # this process (the shipped two-stage run is covered by the README command and test_cli.py).
    monkeypatch.chdir(tmp_path)  # the config writes runs/digits/supernet.ckpt
    cli = digits.cli_main(["fit", "--config", str(EXAMPLES / "digits.yaml"), "--trainer.max_steps", "6",
                           "--trainer.devices", "1",
                           "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert isinstance(cli.trainer.strategy, lnp.NASPipeStrategy)
    assert cli.trainer.strategy.window == 8
    assert cli.trainer.max_epochs == 40
    assert cli.trainer.global_step == 6
    assert (tmp_path / "runs" / "digits" / "supernet.ckpt").is_file()  # where digits_search.yaml reads it


@pytest.mark.slow
def test_ofa_example_trains_searches_and_exports_a_smaller_subnet(tmp_path: Path) -> None:
    """examples/ofa_digits.py end to end on 2 stage processes (sandwich rule, distillation, FLOPs-budgeted search)."""
    import subprocess

    script = Path(__file__).parents[1] / "examples" / "ofa_digits.py"
    done = subprocess.run([sys.executable, str(script), "--epochs", "1", "--out", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("sandwich: best"))
    params, total = re.search(r"(\d+) parameters; the supernet has (\d+)", line).groups()  # type: ignore[union-attr]
    assert int(params) < int(total) and (tmp_path / "best_subnet_sandwich").is_dir()
