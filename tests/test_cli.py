"""naspipe_cli: the ``search`` subcommand reads the fit config, and the digits example runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import EXAMPLES, FEATURES, QUIET, TOY_NETS, load_example, toy_loader
from lightning_naspipe.integration.cli import _cli_class, _with_search
from lightning_naspipe.namespaces import installed
from lightning_naspipe.searching.search_loop import read_log

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


class ToyData(L.LightningDataModule):
    """The toy data as a datamodule, for a CLI of the toy net."""

    def __init__(self, samples: int = 32) -> None:
        super().__init__()
        self.samples = samples

    def train_dataloader(self) -> Any:
        return toy_loader(self.samples)

    def val_dataloader(self) -> Any:
        return toy_loader(16, shuffle=False)


#: A fit whose logger has a fixed version (its folder is the run's: metrics.csv, config.yaml).
TOY_FIT = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: "{root}", name: "", version: ""}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{root}", filename: supernet, enable_version_counter: false}}
"""


def _toy_cli(args: list[str]) -> Any:
    # No save_config_kwargs: search must work with LightningCLI's defaults.
    return lnp.naspipe_cli(TOY_NETS[L], ToyData, seed_everything_default=1, args=args)


@pytest.fixture(scope="module")
def toy_fit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a toy fit run from a config file: its config.yaml, metrics.csv and supernet.ckpt."""
    root = tmp_path_factory.mktemp("toy_fit")
    (root / "fit.yaml").write_text(TOY_FIT.format(root=root))
    argv, sys.argv = sys.argv, ["toy.py"]
    try:
        _toy_cli(["fit", "--config", str(root / "fit.yaml")])
    finally:
        sys.argv = argv
    assert {"config.yaml", "metrics.csv", "supernet.ckpt"} <= {p.name for p in root.iterdir()}
    return root


@pytest.mark.usefixtures("clean_argv")
def test_search_runs_on_the_config_fit_saved_and_leaves_fits_logs_alone(toy_fit: Path) -> None:
    fits = {name: (toy_fit / name).read_bytes() for name in ("config.yaml", "metrics.csv")}
    for _ in range(2):  # again, as a rerun or a resumed search would: its own config is replaced, not refused
        cli = _toy_cli(["search", "--config", str(toy_fit / "config.yaml"),
                        "--ckpt_path", str(toy_fit / "supernet.ckpt"),
                        "--searcher", json.dumps({"class_path": "lightning_naspipe.GridSearch"})])
        assert {name: (toy_fit / name).read_bytes() for name in fits} == fits
    search = toy_fit / "search"  # the fixed version's search sub-folder
    assert cli.trainer.log_dir == str(search) and (search / "search_config.yaml").is_file()
    rows = (search / "metrics.csv").read_text().splitlines()
    assert "search/score" in rows[0] and len(rows) == 1 + 9  # the toy space's 9 architectures, once


@pytest.mark.usefixtures("clean_argv")
@pytest.mark.parametrize("searcher", [
    lnp.RandomSearch(3, seed=5), lnp.EvolutionSearch(population=3, sample_size=2, cycles=2, seed=1),
    lnp.SPOSSearch(population=2, parents=1, mutations=1, crossovers=0, generations=2, seed=3), lnp.GridSearch(50),
], ids=lambda searcher: type(searcher).__name__)
def test_the_printed_search_config_reloads_with_every_searcher(toy_fit: Path, searcher: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"class_path": f"lightning_naspipe.{type(searcher).__name__}", "init_args": asdict(searcher)}
    with pytest.raises(SystemExit):
        _toy_cli(["search", "--config", str(toy_fit / "fit.yaml"), "--ckpt_path", str(toy_fit / "supernet.ckpt"),
                  "--searcher", json.dumps(spec), "--log_path", str(tmp_path / "log.jsonl"), "--print_config"])
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    cli = _toy_cli(["search", "--config", str(printed)])
    assert cli.config_init["search"]["searcher"] == searcher
    assert len(read_log(tmp_path / "log.jsonl")) == {"RandomSearch": 3, "EvolutionSearch": 5, "SPOSSearch": 4,
                                                      "GridSearch": 9}[type(searcher).__name__]


@pytest.mark.usefixtures("clean_argv")
def test_search_takes_latency_constraints_and_a_penalty_from_the_same_config_file(toy_fit: Path,
                                                                                 tmp_path: Path) -> None:
    supernet = TOY_NETS[L]().supernet
    measured = lnp.LatencyTable.measure(supernet, torch.randn(8, FEATURES), repeats=1)
    # Known entries (what matters is the file): 1 ms per fixed block, candidate k of every choice costs k + 1 ms.
    table = lnp.LatencyTable(tuple(tuple(float(k + 1) for k in range(len(row))) if label else (1.0,)
                                   for row, label in zip(measured.entries, measured.labels)),
                             measured.labels, "cpu", 8)
    table.save(tmp_path / "latency.json")
    budget = table.fastest_ms() + 1.5
    (tmp_path / "search.yaml").write_text(f"""
ckpt_path: "{toy_fit / 'supernet.ckpt'}"
searcher: {{class_path: lightning_naspipe.GridSearch}}
log_path: "{tmp_path / 'log.jsonl'}"
export_path: "{tmp_path / 'best'}"
constraints:
  latency: "{tmp_path / 'latency.json'}"
  max_latency_ms: {budget}
  penalty: {{target_ms: {table.fastest_ms()}, alpha: -0.07, beta: -0.5}}
""")
    cli = _toy_cli(["search", "--config", str(toy_fit / "fit.yaml"), "--config", str(tmp_path / "search.yaml")])
    constraints = cli.config_init["search"]["constraints"]
    assert isinstance(constraints, lnp.Constraints) and constraints.table == table
    records = read_log(tmp_path / "log.jsonl")
    every = [dict(zip(supernet.labels, v)) for v in __import__("itertools").product(
        *(range(n) for n in supernet.labels.values()))]
    expected = [supernet.canonical(a) for a in every if supernet.canonical(a) == a and table.predict(a) <= budget]
    assert [r.architecture for r in records] == expected and len(expected) < len(every)
    penalty = lnp.LatencyPenalty(table.fastest_ms(), -0.07, -0.5)
    for r in records:
        assert r.latency_kind == "predicted" and r.latency_ms == table.predict(r.architecture) <= budget
        assert r.penalized_score == r.score / penalty.factor(r.latency_ms)  # a loss: divided by the factor
    best = min(records, key=lambda r: (r.penalized_score, r.index))
    saved = json.loads((tmp_path / "best" / "architecture.json").read_text())
    assert saved["architecture"] == best.architecture
    assert saved["latency"]["ms"] > 0 and saved["latency"]["device"] == "cpu" and saved["latency"]["batch_size"] > 0


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
