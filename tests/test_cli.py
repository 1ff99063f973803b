"""naspipe_cli: the ``search`` subcommand reads the fit config, and the digits example runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import EXAMPLES, QUIET, TOY_NETS, load_example
from lightning_naspipe.cli import _cli_class, _with_search
from lightning_naspipe.namespaces import installed
from lightning_naspipe.search_loop import read_log

torch.set_num_threads(1)
SEARCHER = {"class_path": "lightning_naspipe.SPOSSearch",
            "init_args": {"population": 6, "parents": 2, "mutations": 2, "crossovers": 2, "generations": 3}}
SEARCH_ARGS = ["--config", str(EXAMPLES / "digits.yaml"), "--config", str(EXAMPLES / "digits_search.yaml"),
               "--searcher", json.dumps(SEARCHER), "--max_flops", "1500000"]


@pytest.fixture(scope="module")
def digits() -> ModuleType:
    return load_example("digits_spos")


@pytest.fixture
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["digits_spos.py"])  # LightningCLI warns about pytest's own argv


@pytest.fixture(scope="module")
def checkpoint(digits: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fit")
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = ["digits_spos.py"]
    os.chdir(root)  # the config's paths are relative: runs/digits/...
    try:
        digits.cli_main(["fit", "--config", str(EXAMPLES / "digits.yaml"), "--trainer.devices", "1",
                         "--trainer.max_steps", "46", *QUIET])
    finally:
        sys.argv = argv
        os.chdir(cwd)
    return root / "runs" / "digits" / "supernet.ckpt"


def _direct_search(digits: ModuleType, checkpoint: Path) -> lnp.SearchResult:
    """The same search by hand: load the checkpoint, lnp.search on the validation loader."""
    model = digits.DigitsSupernet.load_from_checkpoint(checkpoint, map_location="cpu")
    data = digits.DigitsDataModule()
    data.setup("validate")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    return lnp.search(trainer, model, lnp.SPOSSearch(**SEARCHER["init_args"]), data.val_dataloader(),
                      max_flops=1_500_000)


@pytest.mark.usefixtures("clean_argv")
def test_search_subcommand_reads_the_fit_config_and_exports_the_best(digits: ModuleType, checkpoint: Path,
                                                                     tmp_path: Path) -> None:
    digits.cli_main(["search", *SEARCH_ARGS, "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path),
                     "--ckpt_path", str(checkpoint), "--log_path", str(tmp_path / "log.jsonl"),
                     "--plot_path", str(tmp_path / "search.png"), "--export_path", str(tmp_path / "best"), *QUIET])
    expected = _direct_search(digits, checkpoint)
    assert read_log(tmp_path / "log.jsonl") == expected.history and len(expected.history) == 18
    assert all(r.flops <= 1_500_000 for r in expected.history)
    assert json.loads((tmp_path / "best" / "architecture.json").read_text())["architecture"] == expected.best
    assert (tmp_path / "search.png").read_bytes()[:4] == b"\x89PNG"
    model = digits.DigitsSupernet.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    x = torch.randn(7, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(lnp.load_subnet(tmp_path / "best")(x), model.supernet(x, expected.best))


@pytest.mark.usefixtures("clean_argv")
def test_search_without_a_checkpoint_says_so(digits: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="--ckpt_path"):
        digits.cli_main(["search", "--config", str(EXAMPLES / "digits.yaml"), "--trainer.devices", "1",
                         "--trainer.default_root_dir", str(tmp_path), *QUIET])


@pytest.mark.usefixtures("clean_argv")
@pytest.mark.parametrize("namespace", installed(), ids=lambda ns: ns.name)
def test_each_namespace_gets_its_own_cli_and_trainer(namespace: Any) -> None:
    cli = _cli_class(namespace)
    assert issubclass(cli, namespace.pytorch_module("cli").LightningCLI)
    assert "search" in cli.subcommands() and "fit" in cli.subcommands()
    trainer = _with_search(namespace.pytorch.Trainer)
    assert issubclass(trainer, namespace.pytorch.Trainer) and callable(trainer.search)
    model_class = TOY_NETS[L if namespace.name == "lightning.pytorch" else pl]
    parsed = lnp.naspipe_cli(model_class, run=False, args=["--trainer.accelerator", "cpu", "--trainer.logger",
                                                           "false", *QUIET])
    assert isinstance(parsed, namespace.pytorch_module("cli").LightningCLI) and hasattr(parsed.trainer, "search")
    with pytest.raises(lnp.NASPipeConfigError, match="Trainer subclass"):
        _with_search(lambda **kwargs: namespace.pytorch.Trainer(**kwargs))


@pytest.mark.slow
def test_digits_end_to_end_on_two_stages(digits: ModuleType, tmp_path: Path) -> None:
    """fit on 2 stages, search on 2 stages (the 1-process search of that checkpoint), fine-tune the export."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*args: str) -> None:
        proc = subprocess.run([sys.executable, str(EXAMPLES / "digits_spos.py"), *args, *QUIET], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("fit", "--config", str(EXAMPLES / "digits.yaml"), "--trainer.max_steps", "46")
    trained = tmp_path / "runs" / "digits" / "supernet.ckpt"
    run("search", *SEARCH_ARGS, "--log_path", "search.jsonl")
    expected = _direct_search(digits, trained)
    assert read_log(tmp_path / "search.jsonl") == expected.history
    assert json.loads((tmp_path / "runs/digits/best_subnet/architecture.json").read_text())["architecture"] == (
        expected.best)
    finetune = load_example("digits_finetune")
    accuracy = finetune.main(["--subnet", str(tmp_path / "runs/digits/best_subnet"), "--checkpoint", str(trained),
                              "--epochs", "2"])
    assert accuracy["before"] == pytest.approx(expected.best_record.score, abs=1e-6)  # the exported weights
    assert accuracy["after"] > accuracy["before"] - 0.05
