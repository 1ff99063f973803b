"""Several stage processes (gloo on CPU): bitwise equal to the plain one-device Trainer.

Each test launches tests/pipeline_run.py, which trains the ToyNet of helpers.py (Adam, step LR,
dropout, BatchNorm, trainable stem and head, an Identity candidate, a shared label, shuffled
data) and writes a normal checkpoint, the per-subnet losses and every rank's weights. Exactness runs
start their stage processes all at once, as torchrun does; the logging test and the failure tests
go through Lightning's own launcher (rank 0 starts the others), as a plain ``python script.py`` does.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from forked import ScriptProcess
from helpers import ToyNet, assert_same_state, toy_loader, train
from test_loss_log import logged_rows

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("pipeline_run.py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    # Results depend on CPU kernels' thread count: pin it like the in-process reference run.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra})
    return env


def _launch(tmp_path: Path, *args: str, name: str = "run", timeout: float = 300, keep_stderr: bool = False,
            lightning_launcher: bool = False, **env: str) -> Any:
    """Run pipeline_run.py; the checkpoint path, or with ``keep_stderr`` what the processes wrote to stderr.

    Several stages start all at once with torchrun's variables (each process imports Lightning, ~7 s here,
    in parallel); ``lightning_launcher`` has rank 0 start the others through Lightning's own launcher
    instead, as ``python script.py`` does for a user (the failure tests below always do).
    """
    out = tmp_path / f"{name}.ckpt"
    command, devices = ["--out", str(out), *args], int(args[args.index("--devices") + 1])
    nodes = int(args[args.index("--num-nodes") + 1]) if "--num-nodes" in args else 1
    if devices * nodes > 1 and not lightning_launcher:
        ranks = torchrun_env(devices * nodes, nodes)
        stderr = run_ranks(tmp_path, SCRIPT, command, [{**rank, **env} for rank in ranks], timeout)
    else:
        proc = subprocess.run([sys.executable, str(SCRIPT), *command], env=_env(**env), cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stderr = proc.stderr
    return stderr if keep_stderr else out


def _state(ckpt: Path) -> dict[str, Any]:
    raw = torch.load(ckpt, weights_only=False)
    return {"model": raw["state_dict"], "optimizer": raw["optimizer_states"][0],
            "losses": torch.load(f"{ckpt}.losses", weights_only=False), "global_step": raw["global_step"]}


def _plain_state(tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    model, trainer = train(kwargs.pop("strategy", None), **kwargs)
    path = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(path)
    torch.save(model.losses, f"{path}.losses")
    return _state(path)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plain_state(tmp_path_factory.mktemp("plain"), max_epochs=2)


# Messages travel through shared memory by default (stages on one host); "torch" is gloo's point-to-point.
# The default settings on 2 stages: test_default_split_is_timed_on_the_first_batch_and_changes_nothing.
@pytest.mark.parametrize("stages, window, timed_split, transport, rebalance",
                         [(3, 1, True, "auto", False), (3, 8, False, "torch", True)])
def test_stages_equal_plain_trainer(tmp_path: Path, plain: dict, stages: int, window: int, timed_split: bool,
                                    transport: str, rebalance: bool) -> None:
    # With rebalance, a stage cut moves every window (there and back) with weights, buffers and Adam
    # state; test_rebalancing_every_window_with_offload_changes_nothing moves the offloaded host stash too.
    ckpt = _launch(tmp_path, "--devices", str(stages), "--window", str(window), "--transport", transport,
                   *(["--example-input"] if timed_split else []), *(["--force-rebalance"] if rebalance else []))
    assert_same_state(plain, _state(ckpt))
    _assert_every_rank_holds(plain, ckpt, stages)
    if rebalance:
        moves = Path(f"{ckpt}.moves").read_text().split("\n")[:-1]
        assert len(moves) >= stages * (24 // window)  # every rank, one move per window


def test_norm_clipping_on_three_stages_equals_the_plain_trainer(tmp_path: Path, plain: dict) -> None:
    """Trainer(gradient_clip_val=...) clips by the global norm of each subnet's gradients: the stages
    exchange per-tensor norms in every update, and the result is the one-device run's, bit for bit."""
    clipped = _plain_state(tmp_path, max_epochs=2, gradient_clip_val=0.2)
    assert not all(torch.equal(clipped["model"][k], plain["model"][k]) for k in plain["model"]), "it clipped"
    ckpt = _launch(tmp_path, "--devices", "3", "--window", "4", "--clip-val", "0.2")
    assert_same_state(clipped, _state(ckpt))
    _assert_every_rank_holds(clipped, ckpt, 3)


def _assert_every_rank_holds(plain: dict, ckpt: Path, stages: int) -> None:
    """After fit every rank holds the full trained weights, and every stage process used one split
    (a timed split: rank 0's timing, broadcast)."""
    for rank in range(stages):
        weights = torch.load(f"{ckpt}.rank{rank}")
        assert all(torch.equal(weights[k], plain["model"][k]) for k in plain["model"])
    splits = [torch.load(f"{ckpt}.ranges{rank}", weights_only=False) for rank in range(stages)]
    assert all(split == splits[0] for split in splits) and len(splits[0]) == stages


def test_default_split_is_timed_on_the_first_batch_and_changes_nothing(tmp_path: Path, plain: dict) -> None:
    # No balance, no example input: the blocks are timed on pipeline_input(first batch), here with
    # costs that only a split of 4 + 1 blocks balances; the parameter split it starts from is another.
    # Rebalancing off: its measured busy times (not the fake costs) would move the cut after two windows.
    ckpt = _launch(tmp_path, "--devices", "2", "--window", "8", "--fake-block-costs", "1", "1", "1", "1", "50",
                   "--validate-after", "--rebalance-every", "0")
    assert_same_state(plain, _state(ckpt))
    _assert_every_rank_holds(plain, ckpt, 2)
    assert torch.load(f"{ckpt}.ranges0", weights_only=False) == [range(0, 4), range(4, 5)]
    # validate splits the blocks anew (by parameters): a checkpoint after it still has every block's Adam state.
    after_validate = torch.load(f"{ckpt}.after_validate", weights_only=False)["optimizer_states"][0]
    assert_same_state(plain, {**_state(ckpt), "optimizer": after_validate})
    # save_checkpoint on rank 0 only: the file is whole, and the missing peer is named as the cause.
    assert "call it on every process" in Path(f"{ckpt}.rank0only.error").read_text()
    rank0 = torch.load(f"{ckpt}.rank0only", weights_only=False)
    assert_same_state(plain, {**_state(ckpt), "model": rank0["state_dict"], "optimizer": rank0["optimizer_states"][0]})
    timed_on = torch.load(f"{ckpt}.timed_on")
    torch.manual_seed(7)
    ToyNet()  # the same draws from the global RNG as the run before its first shuffle
    first_batch = next(iter(toy_loader()))
    assert torch.equal(timed_on["input"], first_batch[0]) and timed_on["device"] == "cpu"


def test_rebalancing_every_window_with_offload_changes_nothing(tmp_path: Path, plain: dict) -> None:
    # A stage cut moves every window (there and back), with weights, buffers, Adam state and the host
    # stash (the pipelined offload test: 3 stages, the result equals the plain Trainer's). Without
    # offload: test_stages_equal_plain_trainer[3-8-False-torch-True].
    ckpt = _launch(tmp_path, "--devices", "3", "--window", "4", "--force-rebalance", "--offload")
    assert_same_state(plain, _state(ckpt))
    moves = Path(f"{ckpt}.moves").read_text().split("\n")[:-1]
    assert len(moves) >= 3 * 6  # 3 ranks, one move per window: 24 subnets / window 4


def test_async_baseline_runs_but_is_not_exact(tmp_path: Path, plain: dict) -> None:
    # Subnets sharing the trainable stem overlap anyway: it must not crash, and must differ.
    ckpt = _launch(tmp_path, "--devices", "2", "--window", "8", "--schedule", "async")
    with pytest.raises(AssertionError):
        assert_same_state(plain, _state(ckpt))


def test_chunks_equal_across_stage_counts(tmp_path: Path) -> None:
    one_stage = _plain_state(tmp_path, strategy=lnp.NASPipeStrategy(window=8, chunks=2), max_epochs=2)
    assert_same_state(one_stage, _state(_launch(tmp_path, "--devices", "2", "--window", "8", "--chunks", "2")))


def test_stop_on_two_stages_resume_on_one_with_another_window_and_namespace(tmp_path: Path, plain: dict) -> None:
    # `plain` ran under pytorch_lightning; the stage processes run lightning.pytorch up to step 10 (mid-window),
    # and the resume reads that checkpoint under pytorch_lightning, on 1 stage, at another window.
    # 2 stages -> 3 stages: test_lookahead_checkpoints_mid_window_pair_and_resumes_bitwise.
    stop = _launch(tmp_path, "--devices", "2", "--window", "4", "--max-steps", "10", name="stop",
                   LNP_TEST_NAMESPACE="lightning.pytorch")
    resumed = _launch(tmp_path, "--devices", "1", "--window", "8", "--resume", str(stop), name="resumed",
                      LNP_TEST_NAMESPACE="pytorch_lightning")
    assert_same_state(plain, _state(resumed))


def test_lookahead_checkpoints_mid_window_pair_and_resumes_bitwise(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice of stems lets stage 0 run the next window's forwards in this window's drain (default
    settings). Checkpoints every 4 subnets are written while such forwards are carried; the run and a
    resume from one of them on 3 stages equal the plain Trainer."""
    monkeypatch.setenv("LNP_TEST_CHOICE_STEM", "1")
    plain = _plain_state(tmp_path, max_epochs=2)
    run = _launch(tmp_path, "--devices", "2", "--window", "4", "--every-n-steps", "4", LNP_TEST_CHOICE_STEM="1")
    assert torch.load(f"{run}.ahead0") > 0, "stage 0 ran forwards ahead"
    assert torch.load(f"{run}.ahead1") == 0, "never the last stage"
    assert_same_state(plain, _state(run))
    middle = Path(f"{run}.steps") / "step=8.ckpt"  # mid-epoch: window 3's forwards had run on stage 0
    assert torch.load(middle, weights_only=False)["global_step"] == 8
    losses = torch.load(f"{run}.losses", weights_only=False)
    torch.save({k: v for k, v in losses.items() if k < 8}, f"{middle}.losses")  # the resumed run adds its own
    resumed = _launch(tmp_path, "--devices", "3", "--resume", str(middle), name="resumed", LNP_TEST_CHOICE_STEM="1")
    assert_same_state(plain, _state(resumed))


def test_logging_and_validation_match_plain_run(tmp_path: Path) -> None:
    warned = _launch(tmp_path, "--devices", "2", "--log-dir", str(tmp_path / "piped"), PYTHONWARNINGS="default",
                     keep_stderr=True, lightning_launcher=True)
    # No warning from the library, and not Lightning's sync_dist advice, which does not apply here.
    assert "sync_dist" not in warned and "lightning_naspipe/" not in warned, warned[-3000:]
    # The plain reference logs the same way, in-process.
    from pytorch_lightning.loggers import CSVLogger

    from helpers import toy_loader
    train(None, max_epochs=2, logger=CSVLogger(tmp_path / "plain", name="", version=""), log_every_n_steps=1,
          loader=toy_loader(), val_loader=toy_loader(samples=40, shuffle=False))
    piped, plain_rows = _epoch_metrics(tmp_path / "piped"), _epoch_metrics(tmp_path / "plain")
    for key in ("val_loss", "val_acc", "train_loss_epoch"):
        assert len(piped[key]) == 2  # one value per epoch
        assert piped[key] == plain_rows[key]
    # Every subnet's training loss at its own step, window or not: the plain run's series.
    steps = [step for step, _, key, _ in logged_rows(tmp_path / "plain") if key == "train_loss_step"]
    assert steps == [str(s) for s in range(24)]
    assert logged_rows(tmp_path / "piped") == logged_rows(tmp_path / "plain")
    best = torch.load(tmp_path / "piped" / "best.ckpt", weights_only=False)  # ModelCheckpoint(monitor="val_loss")
    assert best["callbacks"] and best["global_step"] in (12, 24)


def _epoch_metrics(log_dir: Path) -> dict[str, list[str]]:
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {key: [r[key] for r in rows if r.get(key)] for key in ("val_loss", "val_acc", "train_loss_epoch")}


def _gone_within(pid_files: list[Path], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    pids = [int(p.read_text()) for p in pid_files]
    while time.monotonic() < deadline:
        if not any(_running(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie has exited: an orphan's zombie stays listed where the container's
    PID 1 does not reap, so signal 0 alone would call it alive."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("target", ["-2", "1"], ids=["every-stage", "stage-1"])
def test_sigterm_stops_every_stage_with_a_checkpoint_that_resumes_bitwise(tmp_path: Path, plain: dict,
                                                                          target: str) -> None:
    # The stages' timeout (600 s) outlasts the hang protection (240 s): a stage that waited for it fails the test.
    out = tmp_path / "run.ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--devices", "3", "--window", "4",
                           "--timeout", "600", "--kill-stage", target, "--kill-step", "9",
                           "--kill-signal", str(int(signal.SIGTERM)),
                           "--exception-checkpoint", str(tmp_path / "exc")],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    saved = tmp_path / "exc" / "on_exception.ckpt"
    assert saved.exists(), proc.stderr[-3000:]
    assert not out.exists()  # training stopped early
    assert _gone_within(sorted(tmp_path.glob("run.ckpt.pid*")), 30)
    stopped_at = torch.load(saved, weights_only=False)["global_step"]
    assert 9 <= stopped_at < 24
    if target != "1":
        return  # resuming is the same for both: checked once
    resumed = _state(_launch(tmp_path, "--devices", "3", "--resume", str(saved), name="resumed"))
    assert set(resumed["losses"]) == set(range(stopped_at, 24))
    assert_same_state({**plain, "losses": {i: plain["losses"][i] for i in resumed["losses"]}}, resumed)


@pytest.mark.parametrize("signum", [9, 0], ids=["killed", "raised"])
def test_failed_stage_ends_the_run_naming_it(tmp_path: Path, signum: int) -> None:
    # The stages' timeout (600 s) outlasts the hang protection (240 s): a stage that waited for it fails the test.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "k.ckpt"), "--devices", "3", "--window", "4",
         "--timeout", "600", "--kill-stage", "2", "--kill-step", "8", "--kill-signal", str(signum)],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    # Rank 0's last words, the error the user sees, name the stage; for an error, its cause too.
    last_words = proc.stderr.strip().splitlines()[-3:]
    assert any("Pipeline stage" in line and "failed or exited" in line for line in last_words), last_words
    if signum == 0:
        assert any("Pipeline stage 2 (rank 2) raised ValueError: injected failure on rank 2" in line
                   for line in last_words), proc.stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "k.ckpt")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


@pytest.mark.parametrize("stage, signum", [(1, signal.SIGSTOP), (0, signal.SIGKILL)],
                         ids=["stage-1-stopped", "launcher-killed"])
def test_no_stage_process_outlives_a_failed_run(tmp_path: Path, stage: int, signum: int) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "run.ckpt"), "--devices", "2",
                           "--window", "4", "--timeout", "5", "--kill-stage", str(stage), "--kill-step", "9",
                           "--kill-signal", str(int(signum))],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # The run ends (the 5 s timeout detects the stopped stage; subprocess.run's 120 s guards against a hang) and
    # leaves no stage process behind: a stopped one is killed by the launcher at its exit, survivors die with
    # their parent.
    assert _gone_within(sorted(tmp_path.glob("run.ckpt.pid*")), 5), proc.stderr[-2000:]


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun_env(ranks: int, nodes: int = 1) -> list[dict[str, str]]:
    """Each rank's variables as torchrun sets them on ``nodes`` nodes of ``ranks / nodes`` processes, each node a
    contiguous block of global ranks (Lightning then launches nothing)."""
    per_node = ranks // nodes
    return [{"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(per_node),
             "GROUP_RANK": str(rank // per_node), "NODE_RANK": str(rank // per_node), "RANK": str(rank),
             "LOCAL_RANK": str(rank % per_node)} for rank in range(ranks)]


def run_ranks(tmp_path: Path, script: Path, args: list[str], rank_env: list[dict[str, str]],
              timeout: float = 300) -> str:
    """Start one ``script`` process per rank, as a cluster would, wait for all of them to succeed; their stderr.

    The processes are forked from a server that imported torch and Lightning once (forked.py), not fresh
    interpreters: the same script, argv and environment, without seconds of imports per rank.

    The rendezvous port is picked free, then closed before rank 0 binds it, so another process may
    take it in between: a launch that fails for that reason alone is retried on a new port.
    """
    for attempt in range(3):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port()}
        procs = [ScriptProcess(script, args, {**_env(), **env, **extra}, tmp_path) for extra in rank_env]
        try:
            deadline = time.monotonic() + timeout
            errors = [p.wait(max(deadline - time.monotonic(), 0.0)) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if all(p.returncode == 0 for p in procs):
            return "".join(errors)
        if not any("address already in use" in e.lower() for e in errors) or attempt == 2:
            raise AssertionError("".join(e[-2000:] for e in errors))
    raise AssertionError("unreachable")


def test_two_nodes_on_localhost(tmp_path: Path, plain: dict) -> None:
    out = tmp_path / "nodes.ckpt"
    run_ranks(tmp_path, SCRIPT, ["--out", str(out), "--devices", "1", "--num-nodes", "2", "--window", "8"],
              [{"NODE_RANK": str(node)} for node in (0, 1)])
    assert_same_state(plain, _state(out))


def test_slurm_requeue_signal_saves_at_a_window_boundary_and_training_goes_on(tmp_path: Path, plain: dict) -> None:
    # Two srun tasks: Lightning's SLURM requeue handler (SIGUSR1) saves a checkpoint, a collective.
    # Sent to one stage mid-window, it must run on both stages at the next boundary and change nothing.
    out = tmp_path / "slurm.ckpt"
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lnp-test"}
    run_ranks(tmp_path, SCRIPT, ["--out", str(out), "--devices", "2", "--window", "4", "--kill-stage", "1",
                                 "--kill-step", "9", "--kill-signal", str(int(signal.SIGUSR1))],
              [{**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "LOCAL_RANK": str(r)} for r in (0, 1)])
    assert_same_state(plain, _state(out))
    saved = tmp_path / "hpc_ckpt_1.ckpt"
    stopped_at = torch.load(saved, weights_only=False)["global_step"]
    assert stopped_at in (12, 16)  # the window after the signal arrived, not its middle
    resumed = _state(_launch(tmp_path, "--devices", "2", "--window", "4", "--resume", str(saved), name="resumed"))
    assert_same_state({**plain, "losses": {i: plain["losses"][i] for i in resumed["losses"]}}, resumed)


def test_a_measured_latency_search_on_stages_agrees_on_every_process(tmp_path: Path) -> None:
    """Rank 0 times each architecture and every stage process takes its number: the same records everywhere, each
    with its measured latency, and every measurement in the log; so does a budgeted search's check of its best."""
    out = _launch(tmp_path, "--devices", "2", "--window", "8", "--search", "--search-measured")
    histories = [torch.load(f"{out}.search{rank}", weights_only=False) for rank in range(2)]
    assert histories[0] == histories[1] and histories[0]
    assert all(r.latency_kind == "measured" and r.latency_ms is not None and r.latency_ms > 0 for r in histories[0])
    logged = Path(f"{out}.search.jsonl").read_text()
    assert all(repr(r.latency_ms) in logged for r in histories[0])
    # The checked winner (a table, a budget, the best-scored measuring over): the same check and best on every
    # process, and as one process decides on the same weights.
    from pipeline_run import checked_search

    checked = [torch.load(f"{out}.checked{rank}", weights_only=False) for rank in range(2)]
    assert checked[0] == checked[1]
    records, best = checked[0]
    ranked = sorted(records, key=lambda checked_record: checked_record[0].score)
    assert [(ms, over) for _, ms, over in ranked[:2]] == [(9.0, True), (0.5, False)]
    assert best == ranked[1][0].architecture and all(ms is None for _, ms, _ in ranked[2:])
    model = ToyNet()
    model.load_state_dict(torch.load(f"{out}.rank0", weights_only=False))
    with pytest.warns(UserWarning, match="measures 9.0000 ms end to end"):
        assert checked_search(None, model) == checked[0]


def test_search_after_a_pipelined_fit_equals_the_one_device_search(tmp_path: Path) -> None:
    from pipeline_run import SEARCHER

    out = _launch(tmp_path, "--devices", "2", "--window", "8", "--search")
    model, trainer = train(max_epochs=2)
    expected = lnp.search(trainer, model, SEARCHER, toy_loader(samples=40, shuffle=False),
                          calibration=toy_loader(samples=16, shuffle=False)).history
    for rank in range(2):  # the same records, scores bit for bit, on every stage
        assert torch.load(f"{out}.search{rank}", weights_only=False) == expected


def test_resume_into_another_space_is_refused_on_every_stage(tmp_path: Path) -> None:
    """Each stage process reads the checkpoint and refuses it, naming the difference, before any collective of
    the run: no stage waits for another that stopped."""
    _, trainer = train(max_steps=4)
    ckpt = tmp_path / "four.ckpt"
    trainer.save_checkpoint(ckpt)
    # The stages' timeout (180 s) outlasts the launch's (120 s, which kills both): a stage that waited for the
    # other never prints its refusal, and the count below is short.
    with pytest.raises(AssertionError) as failed:
        _launch(tmp_path, "--devices", "2", "--resume", str(ckpt), timeout=120, LNP_TEST_EXTRA_CANDIDATE="1")
    assert str(failed.value).count(
        f"NASPipeConfigError: The checkpoint {ckpt} was trained on another search space than {ToyNet.__name__}'s "
        "supernet: choice 'block1' (blocks.1) had candidates [Sequential, Identity, Sequential] in the checkpoint, now "
        "[Sequential, Identity, Sequential, Identity].") == 2, str(failed.value)
