"""Speed guard: a few short cases of different kinds, each 2 processes against 1 device in one run; run by .ci/run
after the tests.

A smoke detector for regressions in the pipelined path (per window, per epoch, start-up), not a target: each case
fails only below a floor well under its measured ratio (a 2x regression falls below it, noise does not), and every
ratio is printed so that CI's log keeps the history (docs/benchmarks.md, "Speed guard", keeps a table by version).
A case's time is ``trainer.fit`` on rank 0, start-up (setup, the timed split, ``num_stages="auto"``'s profile and
rebuild, as a first run pays them: every run gets an empty profile cache) and the end of training included;
Python's imports and process starts are not (the ranks start the clock together). Training alone
(``on_train_start`` to ``on_train_end``, the shared guard's clock) is printed beside it, not guarded. Default strategy
settings but where a case names one::

    python benchmarks/speed_guard.py                       # 2 rounds, alternating 1 and 2 processes; best of each
    python benchmarks/speed_guard.py --delay-epoch-end 0.5  # checks the guard: every epoch end of the 2-process
                                                            # runs is made 0.5 s slower, and the guard must fail

Exit status 1 when a case is below its floor or failed to run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from lightning_naspipe.integration.profile_cache import ENV as CACHE_ENV
from common import every_rank_started, launch, machine, ran_as_worker
from spos_cnn import SposCNN, random_images
from zoo_spaces import features_loader

SCRIPT = os.path.abspath(__file__)


@dataclass(frozen=True)
class Case:
    """One guarded case: ``steps`` training steps of ``space`` with ``strategy`` on 2 processes, against 1 device."""

    name: str
    space: str
    steps: int
    batches_per_epoch: int
    strategy: dict[str, Any]
    floor: float


#: The cases; floors well under their ratios on a 2-core host, which vary by 0.2x between runs (docs/benchmarks.md).
CASES = [
    Case("short epochs (8 x 16 MLP, 48 batches/epoch)", "mlp16", 480, 48, {}, 0.8),
    Case("8 ms subnets, 2-window epochs (8 x 32, window 32)", "mlp32", 640, 64, {"window": 32}, 0.8),
    Case("SPOS CNN, num_stages='auto', chunks 2", "cnn", 100, 100, {"num_stages": "auto", "chunks": 2}, 0.7),
    Case("sandwich step (Sandwich(2), 8 x 16 MLP)", "sandwich", 120, 120, {}, 0.8),
]


class ManyChoices(lnp.NASPipeMixin, pl.LightningModule):
    """``blocks`` choice blocks of ``candidates`` x (Linear(256, 256), GELU), no shared block; SGD with momentum."""

    def __init__(self, candidates: int, blocks: int = 8, width: int = 256, sandwich: bool = False) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(*[
            lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(candidates)])
            for _ in range(blocks)])
        if sandwich:
            self.step_sampler = lnp.Sandwich(2)

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def build(space: str, batches: int) -> tuple[pl.LightningModule, Any]:
    """The module and a loader of ``batches`` batches."""
    if space == "cnn":
        return SposCNN(16, 2), random_images(batches * 32, 32)
    candidates = 32 if space == "mlp32" else 16
    return ManyChoices(candidates, sandwich=space == "sandwich"), features_loader(batches, 256, 64)


class DelayEpochEnd(pl.Callback):
    """Sleeps ``seconds`` at every epoch end (``--delay-epoch-end``: a deliberately slowed epoch end)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        time.sleep(self.seconds)


class TrainClock(pl.Callback):
    """Training alone, ``on_train_start`` to ``on_train_end``, as ``../shared/bench/speed_guard.py`` clocks it."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start


def worker(cfg: dict[str, Any]) -> None:
    case = CASES[cfg["case"]]
    module, data = build(case.space, case.batches_per_epoch)
    processes = cfg.get("processes", 1)
    strategy: Any = lnp.NASPipeStrategy(**case.strategy) if processes > 1 else "auto"
    delay = cfg["delay_epoch_end"] if processes > 1 else 0.0
    clock = TrainClock()
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=case.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock, *([DelayEpochEnd(delay)] if delay else [])])
    every_rank_started(cfg)
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    if trainer.global_rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"seconds": seconds, "train_seconds": clock.seconds, "subnets_per_s": case.steps / seconds}, f)


def below_floor(cases: list[Case], ratios: dict[str, float]) -> list[str]:
    """The names of ``cases`` whose ratio is under their floor; a case missing from ``ratios`` failed to run."""
    return [case.name for case in cases if ratios.get(case.name, 0.0) < case.floor]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; each side's fastest is kept")
    parser.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    parser.add_argument("--delay-epoch-end", type=float, default=0.0,
                        help="seconds added to every epoch end of the 2-process runs (to check the guard)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return 0
    chosen = [int(c) for c in args.cases.split(",")] if args.cases else list(range(len(CASES)))
    print(f"speed guard: {machine()}", flush=True)
    ratios: dict[str, float] = {}
    for index in chosen:
        case = CASES[index]
        best = {1: float("inf"), 2: float("inf")}
        train = {1: float("inf"), 2: float("inf")}
        for _ in range(args.rounds):
            for processes in (1, 2):
                with tempfile.TemporaryDirectory() as cache:  # start-up as a first run pays it, every time
                    os.environ[CACHE_ENV] = cache
                    result = launch(SCRIPT, {"case": index, "processes": processes,
                                             "delay_epoch_end": args.delay_epoch_end})
                if "error" in result:
                    print(f"speed guard: {case.name}: the {processes}-process run failed: {result['error']}")
                    break
                best[processes] = min(best[processes], result["seconds"])
                train[processes] = min(train[processes], result["train_seconds"])
        if best[1] < float("inf") and best[2] < float("inf"):
            ratios[case.name] = best[1] / best[2]
            print(f"speed guard: {case.name}: 1 device {best[1]:.2f} s, 2 processes {best[2]:.2f} s, "
                  f"ratio {ratios[case.name]:.2f}x (floor {case.floor:.2f}x); training alone "
                  f"{train[1]:.2f} s / {train[2]:.2f} s = {train[1] / train[2]:.2f}x", flush=True)
    failed = below_floor([CASES[i] for i in chosen], ratios)
    if failed:
        print(f"speed guard: FAILED, below the floor or not run: {'; '.join(failed)}. Profile the pipelined path "
              "(per window, per epoch, start-up) before merging: docs/benchmarks.md, 'Speed guard'.")
        return 1
    print(f"speed guard: all {len(chosen)} cases at or above their floors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
