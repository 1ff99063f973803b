"""Stages x data-parallel replicas (gloo on CPU): bitwise the plain one-device Trainer with the same chunks.

ToyNet (helpers.py) has a trainable stem and head, BatchNorm, dropout and Adam; with ``chunks=4`` each
replica trains its contiguous share of every batch's micro-batches and the replicas chain their sums in
micro-batch order (lightning_naspipe/pipeline/exactness/replicas.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, toy_loader
from test_pipeline import SCRIPT, _env, _launch, _plain_state, _state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain_chunks4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plain_state(tmp_path_factory.mktemp("plain4"), strategy=lnp.NASPipeStrategy(window=8, chunks=4),
                        max_epochs=2)


@pytest.mark.parametrize("devices, stages, transport", [(2, 2, "auto"), (2, 1, "auto"), (4, 2, "auto"),
                                                        (4, 2, "torch")])
def test_replicas_equal_the_plain_trainer(tmp_path: Path, plain_chunks4: dict, devices: int, stages: int,
                                          transport: str) -> None:
    """``transport="torch"``: the replicas' sums and per-window gathers take torch.distributed point to point, as
    with NCCL or several hosts, instead of shared memory."""
    ckpt = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--window", "4",
                   "--chunks", "4", "--transport", transport)
    assert_same_state(plain_chunks4, _state(ckpt))
    for rank in range(devices):  # every rank holds the whole trained supernet after fit
        weights = torch.load(f"{ckpt}.rank{rank}")
        assert all(torch.equal(weights[k], plain_chunks4["model"][k]) for k in plain_chunks4["model"])


def test_two_nodes_of_two_run_a_pipeline_each_and_equal_the_plain_trainer(tmp_path: Path, plain_chunks4: dict) -> None:
    """``Trainer(num_nodes=2, devices=2)``, torchrun's variables for two nodes on this host: 2 stages x 2 replicas
    with ranks replica-major, so each node runs one whole pipeline and the replicas' sums cross nodes."""
    stderr = _launch(tmp_path, "--devices", "2", "--num-nodes", "2", "--num-stages", "2", "--window", "4",
                     "--chunks", "4", "--transport", "torch", keep_stderr=True)
    assert_same_state(plain_chunks4, _state(tmp_path / "run.ckpt"))
    table = stderr[stderr.index("NASPipe stages:"):]
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:4]] == ["0, 2", "1, 3"], table


class ToyNetInTwoChunks(ToyNet):
    chunks = 2


def test_a_module_with_chunks_equals_the_plain_trainer_on_stages_and_on_replicas(tmp_path: Path) -> None:
    """``chunks`` set on the module: the plain Trainer (no strategy) splits each batch alike, and 2 stages and
    1 stage x 2 replicas with the strategy at its defaults (it follows the module) equal it bitwise."""
    plain = _plain_state(tmp_path, model_cls=ToyNetInTwoChunks, max_epochs=2)
    one_chunk = _plain_state(tmp_path, max_epochs=2)
    assert not all(torch.equal(plain["model"][k], one_chunk["model"][k]) for k in plain["model"]), "chunks mattered"
    for devices, stages in ((2, 2), (2, 1)):
        ckpt = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--module-chunks", "2",
                       name=f"chunks2-{stages}")
        assert_same_state(plain, _state(ckpt))


def test_resume_from_two_by_two_onto_other_layouts(tmp_path: Path, plain_chunks4: dict) -> None:
    """A checkpoint of S=2 x D=2 (mid-window, step 10) resumes on S=1 x D=2 and on S=3 x D=1, bitwise."""
    stop = _launch(tmp_path, "--devices", "4", "--num-stages", "2", "--window", "4", "--chunks", "4",
                   "--max-steps", "10", name="stop")
    for devices, stages in ((2, 1), (3, 3)):
        resumed = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--window", "8",
                          "--chunks", "4", "--resume", str(stop), name=f"resumed{devices}")
        assert_same_state(plain_chunks4, _state(resumed))


def test_eight_processes_as_one_by_eight_and_two_by_four_and_a_resume_onto_one_by_two(tmp_path: Path) -> None:
    """8 processes on this 2-core host: 1 stage x 8 replicas and 2 stages x 4 replicas (batches of 16 in 8
    micro-batches of 2, so each of 8 replicas trains one) equal the plain Trainer with the same chunks, and the
    2 x 4 run's step-5 checkpoint (mid-window, mid-epoch) resumes onto 1 stage x 2 replicas, bitwise."""
    plain = _plain_state(tmp_path, strategy=lnp.NASPipeStrategy(window=8, chunks=8), loader=toy_loader(batch_size=16),
                         max_epochs=2)
    common = ("--devices", "8", "--window", "4", "--chunks", "8", "--batch-size", "16", "--timeout", "600")
    for name, stages, ranks in (("one-by-eight", 1, ["0, 1, 2, 3, 4, 5, 6, 7"]),
                                ("two-by-four", 2, ["0, 1, 2, 3", "4, 5, 6, 7"])):
        stderr = _launch(tmp_path, *common, "--num-stages", str(stages), "--every-n-steps", "5", name=name,
                         timeout=600, keep_stderr=True)
        table = stderr[stderr.index("NASPipe stages:"):].splitlines()[2:2 + stages]
        assert [line.split("|")[1].strip() for line in table] == ranks, table
        assert_same_state(plain, _state(tmp_path / f"{name}.ckpt"))
    deep = tmp_path / "two-by-four.ckpt"
    stop = tmp_path / "two-by-four.ckpt.steps" / "step=5.ckpt"
    # The resumed run records the losses of steps 5 on; those before the stop come from the 2 x 4 run.
    torch.save({k: v for k, v in _state(deep)["losses"].items() if k < 5}, f"{stop}.losses")
    resumed = _launch(tmp_path, "--devices", "2", "--num-stages", "1", "--window", "4", "--chunks", "8",
                      "--batch-size", "16", "--resume", str(stop), name="resumed")
    assert_same_state(plain, _state(resumed))


@pytest.mark.parametrize("signum", [0, 9], ids=["raised", "killed"])
def test_a_failed_replica_ends_the_run_naming_it(tmp_path: Path, signum: int) -> None:
    # The processes' timeout (600 s) outlasts the hang protection (240 s): one that waited for it fails the test.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "k.ckpt"), "--devices", "4", "--num-stages", "2",
         "--chunks", "4", "--window", "4", "--timeout", "600", "--kill-stage", "3", "--kill-step", "8",
         "--kill-signal", str(signum)],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    last_words = proc.stderr.strip().splitlines()[-3:]  # rank 0's report, the error the user sees
    assert any("failed or exited" in line for line in last_words), proc.stderr[-3000:]
    if signum == 0:
        assert any("Pipeline stage 1 replica 1 (rank 3) raised ValueError: injected failure on rank 3" in line
                   for line in last_words), proc.stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "k.ckpt")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_chunks_the_replicas_cannot_share_are_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "bad.ckpt"), "--devices", "2",
                           "--num-stages", "1", "--chunks", "3"],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "chunks must be a multiple of 2" in proc.stderr, proc.stderr[-3000:]
    assert "in setup" in proc.stderr and "train_window" not in proc.stderr, "refused at setup, not at the first window"


def test_two_by_two_with_rebalancing_offload_validation_and_search(tmp_path: Path, plain_chunks4: dict) -> None:
    """Blocks move every window (replicas of a stage always hold the same ones), offloaded; validation after fit
    and lnp.search run on all four ranks with the one-device results."""
    from pipeline_run import SEARCHER

    from helpers import toy_loader, train

    ckpt = _launch(tmp_path, "--devices", "4", "--num-stages", "2", "--window", "4", "--chunks", "4",
                   "--force-rebalance", "--offload", "--search")
    assert_same_state(plain_chunks4, _state(ckpt))
    splits = [torch.load(f"{ckpt}.ranges{rank}", weights_only=False) for rank in range(4)]
    assert all(split == splits[0] for split in splits) and len(splits[0]) == 2
    assert len(Path(f"{ckpt}.moves").read_text().split("\n")[:-1]) >= 4 * 6  # every rank moved, every window
    model, trainer = train(lnp.NASPipeStrategy(window=8, chunks=4), max_epochs=2)
    expected = lnp.search(trainer, model, SEARCHER, toy_loader(samples=40, shuffle=False),
                          calibration=toy_loader(samples=16, shuffle=False)).history
    for rank in range(4):
        assert torch.load(f"{ckpt}.search{rank}", weights_only=False) == expected


def test_two_by_two_with_lookahead_equals_the_plain_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice of stems lets stage 0 run the next window's forwards in this window's drain, on every replica."""
    monkeypatch.setenv("LNP_TEST_CHOICE_STEM", "1")
    plain = _plain_state(tmp_path, strategy=lnp.NASPipeStrategy(window=8, chunks=4), max_epochs=2)
    ckpt = _launch(tmp_path, "--devices", "4", "--num-stages", "2", "--window", "4", "--chunks", "4",
                   LNP_TEST_CHOICE_STEM="1")
    assert_same_state(plain, _state(ckpt))
    assert sum(torch.load(f"{ckpt}.ahead{rank}") for rank in (0, 1)) > 0, "no forward ran ahead"


def test_replicas_log_and_validate_as_the_plain_trainer(tmp_path: Path) -> None:
    """Every subnet's loss at its own step, validation each epoch and ModelCheckpoint(monitor="val_loss"),
    with one stage of two replicas: the plain run's rows. Validation is sharded (integration/eval_shards.py): the
    two replicas ran the validation batches' forwards between them, each batch once."""
    from pytorch_lightning.loggers import CSVLogger

    from helpers import toy_loader, train
    from test_loss_log import logged_rows

    ckpt = _launch(tmp_path, "--devices", "2", "--num-stages", "1", "--chunks", "4", "--log-dir",
                   str(tmp_path / "piped"), lightning_launcher=True)
    evals = [torch.load(f"{ckpt}.evals{rank}") for rank in (0, 1)]
    # The sanity check's 2 batches (one group), then 5 per epoch (40 samples of 8) for 2 epochs: groups [0, 1] and
    # [2, 3], and batch 4 alone unsharded (both replicas run it). ToyNet's validation_step calls subnet_output twice
    # per batch (the loss, then val_acc): the second call takes the group's output too. 5 group forwards and 2 x 2 of
    # batch 4 per replica, where unsharded each replica ran 12 x 2.
    assert [e["forwards"] for e in evals] == [5 + 4] * 2, evals
    assert all(e["groups"] == 5 and e["sharded"] == 4 + 8 + 8 and e["unsharded"] == 2 + 2 for e in evals), evals
    train(lnp.NASPipeStrategy(window=8, chunks=4), max_epochs=2,
          logger=CSVLogger(tmp_path / "plain", name="", version=""), log_every_n_steps=1, loader=toy_loader(),
          val_loader=toy_loader(samples=40, shuffle=False))
    rows = logged_rows(tmp_path / "plain")
    assert [step for step, _, key, _ in rows if key == "train_loss_step"] == [str(s) for s in range(24)]
    assert any(key == "val_loss" for _, _, key, _ in rows)
    assert logged_rows(tmp_path / "piped") == rows


@pytest.mark.parametrize("devices, forced", [(2, 1), (4, 2), (2, None)], ids=["2x1-to-1x2", "4x1-to-2x2", "planned"])
def test_auto_layout_switches_before_the_first_window_and_changes_nothing(tmp_path: Path, plain_chunks4: dict,
                                                                          devices: int, forced: int | None) -> None:
    """num_stages="auto" starts with one stage per process; the first batch chooses (here forced, or the planner's
    own choice) and every rank rebuilds its part before the first window trains. The loggers record the choice."""
    stderr = _launch(tmp_path, "--devices", str(devices), "--num-stages", "auto", "--window", "4", "--chunks", "4",
                     "--csv-logger", str(tmp_path / "logs"),
                     *(["--force-layout", str(forced)] if forced is not None else []), keep_stderr=True)
    ckpt = tmp_path / "run.ckpt"
    assert_same_state(plain_chunks4, _state(ckpt))
    splits = [torch.load(f"{ckpt}.ranges{rank}", weights_only=False) for rank in range(devices)]
    assert all(split == splits[0] for split in splits)
    hparams = yaml.safe_load((tmp_path / "logs" / "hparams.yaml").read_text())
    assert hparams["naspipe/num_stages"] == len(splits[0]) and hparams["naspipe/replicas"] == devices // len(splits[0])
    if forced is not None:
        assert len(splits[0]) == forced and hparams["naspipe/layout_chosen_by"] == "forced"
    else:
        assert "num_stages='auto' chose" in stderr and "predicted subnets/s per stages x replicas: 1 x 2:" in stderr
        assert hparams["naspipe/layout_chosen_by"] == "planner" and hparams["naspipe/predicted_rate"] > 0
        assert hparams["naspipe/predicted_rates"] in stderr


def test_sigterm_on_one_replica_stops_every_rank_at_one_window_with_a_checkpoint_that_resumes(
        tmp_path: Path, plain_chunks4: dict) -> None:
    """Preemption flags are agreed in each pipeline and then across the replicas: a SIGTERM to stage 1's second
    replica alone stops all four ranks at the same window; the checkpoint resumes on 2 stages bitwise."""
    out = tmp_path / "run.ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--devices", "4", "--num-stages", "2",
                           "--chunks", "4", "--window", "4", "--kill-stage", "3", "--kill-step", "9",
                           "--kill-signal", "15", "--exception-checkpoint", str(tmp_path / "exc")],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    saved = tmp_path / "exc" / "on_exception.ckpt"
    assert saved.exists(), proc.stderr[-3000:]
    assert not out.exists()  # training stopped early, on every rank
    stopped_at = torch.load(saved, weights_only=False)["global_step"]
    assert 9 <= stopped_at < 24
    resumed = _state(_launch(tmp_path, "--devices", "2", "--chunks", "4", "--resume", str(saved), name="resumed"))
    assert set(resumed["losses"]) == set(range(stopped_at, 24))
    assert_same_state({**plain_chunks4, "losses": {i: plain_chunks4["losses"][i] for i in resumed["losses"]}},
                      resumed)
