"""Shared launching, measuring, reporting and plotting code for the benchmarks.

Pattern (from ``overlap.py``): the parent process describes each configuration as a JSON dict
and runs the *same script* in worker mode in fresh processes (``--worker CONFIG``, the dict naming
the result file), one per rank, with ``OMP_NUM_THREADS=1`` and torchrun's environment variables.
Rank 0 times steady-state training after a warm-up with :class:`Clock` and writes a JSON
result. Fresh processes keep configurations from warming each other's caches and allocators.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from lightning_naspipe.planning.block_timing import timed_block_weights
from lightning_naspipe.pipeline.placement.partition import balanced_split

#: ``subnets_per_s``, ``samples_per_s``, ``subnets``; or ``error`` for a failed run.
Result = dict[str, Any]


def machine(short: bool = False) -> str:
    """One line describing where the numbers come from."""
    if short:
        return f"{os.cpu_count()} CPU cores, 1 thread per process"
    return (f"{os.cpu_count()} CPU cores, torch {torch.__version__}, pytorch-lightning {version('pytorch-lightning')}, "
            "1 intra-op thread per process, gloo between processes")


class Clock(pl.Callback):
    """Times training from the first batch at or after ``warmup`` steps to the end of ``fit``.

    Args:
        warmup: steps (``global_step``) to skip before timing; for NASPipe runs a step is a
            subnet, and timing starts at the first window boundary after it.
        subnets_per_step: subnets trained per ``global_step`` (DDP: one per rank).
    """

    def __init__(self, warmup: int, subnets_per_step: int = 1) -> None:
        self.warmup, self.subnets_per_step = warmup, subnets_per_step
        self.start: float | None = None
        self.start_step, self.elapsed, self.subnets = 0, 0.0, 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.start is None and trainer.global_step >= self.warmup:
            self.start, self.start_step = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.start is None:
            raise RuntimeError(f"training ended before the warm-up of {self.warmup} steps; use more subnets")
        self.elapsed = time.perf_counter() - self.start
        self.subnets = (trainer.global_step - self.start_step) * self.subnets_per_step


def naspipe_strategy(cfg: dict[str, Any]) -> Any:
    """The strategy a config names: ``"auto"`` for the plain one-device Trainer (``stages == 0``)."""
    if cfg["stages"] == 0:
        return "auto"
    return lnp.NASPipeStrategy(window=cfg.get("window", 32), chunks=cfg.get("chunks", 1),
                               schedule=cfg.get("schedule", "csp"), balance=cfg.get("balance"),
                               offload=bool(cfg.get("offload", False)))


def fit_timed(module: pl.LightningModule, data: Any, cfg: dict[str, Any], strategy: Any, devices: int,
              subnets_per_step: int = 1, **trainer_kwargs: Any) -> None:
    """Train ``module`` for one epoch of ``data``; rank 0 writes throughput to ``cfg["out"]``, and
    a NASPipe strategy's ``stage_metrics()`` (offload, telemetry) under ``"metrics"``. ``trainer_kwargs``
    go to the Trainer (e.g. ``gradient_clip_val``)."""
    clock = Clock(cfg["warmup"], subnets_per_step)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock], **trainer_kwargs)
    trainer.fit(module, data)
    metrics = strategy.stage_metrics() if isinstance(strategy, lnp.NASPipeStrategy) else {}  # collective
    if trainer.global_rank == 0:
        rate = clock.subnets / clock.elapsed
        with open(cfg["out"], "w") as f:
            json.dump({"subnets_per_s": rate, "samples_per_s": rate * cfg["batch"], "subnets": clock.subnets,
                       "metrics": metrics}, f)


def rotated_rounds(configs: Sequence[str], spaces: Sequence[str], repeats: int,
                   run: Callable[[str, str], Result]) -> dict[str, list[dict[str, Result]]]:
    """``repeats`` rounds; in each, ``run(configuration, space)`` for every configuration of every space, the
    order of the configurations rotated per round (so none always runs first). Prints each round's rates."""
    found: dict[str, list[dict[str, Result]]] = {name: [] for name in spaces}
    for r in range(repeats):
        order = [*configs[r % len(configs):], *configs[:r % len(configs)]]
        for name in spaces:
            results = {c: run(c, name) for c in order}
            found[name].append(results)
            print(f"[round {r + 1}/{repeats}] {name}: "
                  + ", ".join(f"{c} {rate(results[c]):.2f}" for c in configs) + " subnets/s", flush=True)
    return found


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every benchmark has: repeats, plot path, and the hidden worker mode."""
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration; the best is reported")
    parser.add_argument("--json", default="", help="also write the raw results to this JSON file")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)


def ran_as_worker(args: argparse.Namespace, worker: Callable[[dict[str, Any]], None]) -> bool:
    """In worker mode (``--worker CONFIG``), run ``worker`` on the configuration with one intra-op
    thread and a fixed seed, and say so; else ``False`` (the script is the parent)."""
    if not args.worker:
        return False
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    worker(json.loads(args.worker))
    return True


def launch(script: str, cfg: dict[str, Any], repeats: int = 1, timeout: float = 600.0) -> Result:
    """Run ``script`` in worker mode for ``cfg`` in fresh processes; the best of ``repeats`` runs.

    ``cfg["processes"]`` ranks (default 1) are started at once, torchrun-style (Lightning detects
    the environment and uses it as is): starting them together rather than letting Lightning
    re-launch the script after rank 0 has imported everything saves one interpreter start-up
    per run, which matters on a small machine.

    Returns:
        The result; for a failed run ``{"error": reason}``, so that one failing configuration
        (e.g. a schedule the package cannot run on this space) does not end the benchmark.
    """
    best: Result | None = None
    for _ in range(repeats):
        result = _run_once(script, cfg, timeout)
        if "error" in result:
            return result
        if best is None or result["subnets_per_s"] > best["subnets_per_s"]:
            best = result
    assert best is not None
    return best


def every_rank_started(cfg: dict[str, Any], timeout: float = 120.0) -> None:
    """Wait until every rank of this :func:`launch` run has imported everything and got here (a file barrier
    next to the result file), so that a clock started next does not count another rank's interpreter start."""
    ranks, folder = int(os.environ.get("WORLD_SIZE", "1")), os.path.dirname(cfg["out"])
    open(os.path.join(folder, f"started.{os.environ.get('RANK', '0')}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(name.startswith("started.") for name in os.listdir(folder)) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of {ranks} ranks started within {timeout} s")
        time.sleep(0.005)


def _run_once(script: str, cfg: dict[str, Any], timeout: float) -> Result:
    ranks = max(int(cfg.get("processes", 1)), 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(script), "--worker", json.dumps({**cfg, "out": out})]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        if ranks > 1:
            env.update(TORCHELASTIC_RUN_ID="benchmark", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                       WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0")
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(ranks)]
        procs = []
        for r in range(ranks):
            with open(logs[r], "wb") as log:
                # A session per rank, so a hung run can be ended with everything it started.
                procs.append(subprocess.Popen(cmd, cwd=tmp, env={**env, **_rank_env(ranks, r)},
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
        if all(p.returncode == 0 for p in procs) and os.path.exists(out):
            with open(out) as f:
                result: Result = json.load(f)
            return result
        text = [open(path, errors="replace").read() for path in logs]
        reason = _first_error(text)
        if not reason:  # no exception to name: show how the run ended
            reason = f"exit codes {[p.returncode for p in procs]} (timeout {timeout:.0f} s?)"
            print(f"[benchmark] {cfg} failed; end of rank 0's output:\n{text[0][-1500:]}", file=sys.stderr)
        return {"error": reason}


def _rank_env(ranks: int, rank: int) -> dict[str, str]:
    # A single process gets no rank variables: Lightning would take them for an external launcher.
    return {"RANK": str(rank), "LOCAL_RANK": str(rank)} if ranks > 1 else {}


def _first_error(logs: Sequence[str]) -> str:
    """The root-cause exception line: a neighbour's ``StageFailure`` only says that a stage died."""
    line = re.compile(r"^(?:\[rank\d+\]: )?([\w.]+(?:Error|Exception|Failure): .*)$", re.M)
    found = [m.group(1) for log in logs for m in line.finditer(log)]
    causes = [line for line in found if "StageFailure" not in line]
    return (causes or found or [""])[0][:300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ok(result: Result) -> bool:
    """Whether a run produced numbers."""
    return "error" not in result


def print_table(header: Sequence[str], rows: Sequence[tuple[str, str, Result]], baselines: Sequence[str]) -> None:
    """Print ``(configuration, exact?, result)`` rows with a ratio column per baseline row name.

    A ratio is this row's subnets/s over the baseline's, measured in the same run. Rows whose
    result has a ``model`` entry (see ``schedule_model.py``) get a last column with it. Failed
    runs print ``failed`` and their reason under the table.
    """
    for line in header:
        print(line)
    by_name = {name: result for name, _, result in rows}
    width = max(len(name) for name, _, _ in rows) + 2
    cols = [max(len(b) + 5, 9) for b in baselines]
    heads = "".join(f"{'vs ' + b:>{w}}" for b, w in zip(baselines, cols))
    modelled = any("model" in r for _, _, r in rows)
    print(f"{'configuration':<{width}}{'exact':>6}{'subnets/s':>11}{'samples/s':>11}{heads}"
          + (f"{'model':>8}" if modelled else ""))
    notes = []
    for name, exact, r in rows:
        model = (f"{r['model']:>7.2f}x" if "model" in r else f"{'-':>8}") if modelled else ""
        if not ok(r):
            notes.append(f"  {name}: failed: {r['error']}")
            print(f"{name:<{width}}{exact:>6}{'failed':>11}{'-':>11}" + "".join(f"{'-':>{w}}" for w in cols) + model)
            continue
        ratios = "".join(f"{r['subnets_per_s'] / by_name[b]['subnets_per_s']:>{w - 1}.2f}x" if ok(by_name[b])
                         else f"{'-':>{w}}" for b, w in zip(baselines, cols))
        print(f"{name:<{width}}{exact:>6}{r['subnets_per_s']:>11.2f}{r['samples_per_s']:>11.0f}{ratios}{model}")
    print("\n".join(notes + [""]))


def ratio(a: Result, b: Result) -> float:
    """``a``'s subnets/s over ``b``'s; NaN when either run failed."""
    return a["subnets_per_s"] / b["subnets_per_s"] if ok(a) and ok(b) else float("nan")


def rate(result: Result) -> float:
    """Subnets/s, NaN for a failed run (a gap in a plot)."""
    return result["subnets_per_s"] if ok(result) else float("nan")


def plot(path: str, draw: Callable[[Any], None], title: str, panels: int = 1) -> None:
    """Draw ``panels`` side-by-side axes with ``draw(axes)`` and save a PNG (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(max(7.5, 5.5 * panels), 4.2), squeeze=False)
    draw(axes[0] if panels > 1 else axes[0][0])
    fig.suptitle(textwrap.fill(title, 110 if panels > 1 else 80), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def bar_chart(ax: Any, names: Sequence[str], results: Sequence[Result], baseline: Result, ylabel: str) -> None:
    """Horizontal bars of subnets/s, each labelled with its ratio to ``baseline``."""
    rates = [rate(r) if ok(r) else 0.0 for r in results]
    ax.barh(range(len(names)), rates, color="tab:blue")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    for i, r in enumerate(results):
        ax.text(rates[i], i, f" {ratio(r, baseline):.2f}x" if ok(r) else " failed", va="center", fontsize=8)
    ax.set_xlim(0, max(rates) * 1.25)


def write_json(path: str, data: Any) -> None:
    """Raw results for later comparison (``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def time_balance(supernet: lnp.Supernet, x: torch.Tensor, stages: int) -> list[int]:
    """Blocks per stage balancing *measured* forward+backward time (one thread), not parameters:
    what ``NASPipeStrategy`` does itself when the module sets ``supernet_example_input``."""
    torch.set_num_threads(1)
    split: list[int] = balanced_split(timed_block_weights(supernet, x), stages)
    return split
