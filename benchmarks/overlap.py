"""Does CSP really overlap subnets? Throughput of a wide space on 1 device vs 2 stages.

The space has ``--candidates`` candidates per choice block and no trainable shared block, so
most pairs of subnets are independent on a stage and a window lets them run side by side.
Run from the repository root::

    python benchmarks/overlap.py                 # prints a table of subnets/s and ratios

Each configuration runs in its own processes (one per stage, 1 intra-op thread each) and
measures steady-state training after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp


class WideSpace(lnp.NASPipeMixin, pl.LightningModule):
    """Choice blocks only: every block is ``candidates`` linear layers of ``width`` features."""

    def __init__(self, candidates: int = 32, blocks: int = 8, width: int = 384) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(*[
            lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(candidates)])
            for _ in range(blocks)
        ])

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Clock(pl.Callback):
    """Times subnets ``warmup .. end`` of training (global_step counts subnets)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.start_step = warmup, 0.0, 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.start and trainer.global_step >= self.warmup:
            self.start, self.start_step = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.subnets = trainer.global_step - self.start_step


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    x = torch.randn(args.subnets * args.batch, args.width)
    data = DataLoader(TensorDataset(x, torch.randn_like(x)), batch_size=args.batch)
    clock = Clock(args.warmup)
    strategy: Any = "auto" if args.stages == 0 else lnp.NASPipeStrategy(window=args.window)
    trainer = pl.Trainer(accelerator="cpu", devices=max(args.stages, 1), strategy=strategy, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    trainer.fit(WideSpace(args.candidates, args.blocks, args.width), data)
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"subnets_per_s": clock.subnets / clock.elapsed, "samples_per_s": clock.subnets * args.batch /
                       clock.elapsed}, f)


def measure(args: argparse.Namespace, stages: int, window: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, __file__, "--worker", "--stages", str(stages), "--window", str(window), "--out", out,
               *(f"--{k}={getattr(args, k)}" for k in ("candidates", "blocks", "width", "batch", "subnets", "warmup"))]
        subprocess.run(cmd, check=True, cwd=tmp, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--subnets", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    configs = [("1 device, plain Trainer", 0, 1), ("2 stages, window 1", 2, 1), ("2 stages, window 16", 2, 16)]
    results = {name: measure(args, stages, window) for name, stages, window in configs}
    base = results[configs[0][0]]["subnets_per_s"]
    one_in_flight = results[configs[1][0]]["subnets_per_s"]
    print(f"space: {args.blocks} choice blocks x {args.candidates} candidates, width {args.width}, "
          f"batch {args.batch}; {os.cpu_count()} CPU cores, 1 thread per process")
    print(f"{'configuration':<26}{'subnets/s':>11}{'samples/s':>11}{'vs 1 device':>13}{'vs window 1':>13}")
    for name, _, _ in configs:
        r = results[name]
        print(f"{name:<26}{r['subnets_per_s']:>11.2f}{r['samples_per_s']:>11.0f}"
              f"{r['subnets_per_s'] / base:>12.2f}x{r['subnets_per_s'] / one_in_flight:>12.2f}x")


if __name__ == "__main__":
    main()
