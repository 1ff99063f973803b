"""How much of a stage's partition must be on the device with ``offload=True``?

For spaces of 4..48 candidates per choice block, trains on 2 stages (window 16, Adam, so the
optimizer state counts too) and reports each stage's peak device-resident bytes (parameters,
buffers, optimizer state and gradients of what is in flight or prefetched) against the stage's
whole partition (parameters, buffers and optimizer state of all its blocks). Then the throughput
cost of offload on CPU. Run from the repository root::

    python benchmarks/offload_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap import Clock, WideSpace  # noqa: E402


class AdamWideSpace(WideSpace):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    x = torch.randn(args.subnets * args.batch, args.width)
    data = DataLoader(TensorDataset(x, torch.randn_like(x)), batch_size=args.batch)
    clock = Clock(args.warmup)
    strategy = lnp.NASPipeStrategy(window=args.window, offload=bool(args.offload))
    trainer = pl.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[clock])
    trainer.fit(AdamWideSpace(args.candidates, args.blocks, args.width), data)
    metrics = strategy.stage_metrics()
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"subnets_per_s": clock.subnets / clock.elapsed, "metrics": metrics}, f)


def run(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    settings = {**vars(args), **overrides}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        flags = [f"--{k}={settings[k]}" for k in ("candidates", "blocks", "width", "batch", "subnets", "warmup",
                                                   "window", "stages", "offload")]
        subprocess.run([sys.executable, __file__, "--worker", f"--out={out}", *flags], check=True, cwd=tmp,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        with open(out) as f:
            return dict(json.load(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    parser.add_argument("--candidates", type=int, default=32, help="space of the throughput comparison")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--subnets", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--offload", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{args.stages} stages, window {args.window}, {args.blocks} choice blocks of width {args.width}, Adam; "
          f"{os.cpu_count()} CPU cores, 1 thread per process")
    print(f"{'candidates':>10}" + "".join(f"{f'stage {s} peak / partition':>28}" for s in range(args.stages)))
    for candidates in args.sweep:
        metrics = run(args, candidates=candidates, offload=1)["metrics"]
        cells = []
        for s in range(args.stages):
            peak, part = metrics[f"offload/peak_device_bytes_stage{s}"], metrics[f"offload/partition_bytes_stage{s}"]
            cells.append(f"{peak / 2**20:8.2f} / {part / 2**20:7.2f} MiB {100 * peak / part:5.1f}%")
        print(f"{candidates:>10}" + "".join(f"{c:>28}" for c in cells))
    on = run(args, offload=1, width=384, batch=64)
    off = run(args, offload=0, width=384, batch=64)
    print(f"throughput at {args.candidates} candidates, width 384: offload off {off['subnets_per_s']:.2f} subnets/s, "
          f"on {on['subnets_per_s']:.2f} subnets/s ({on['subnets_per_s'] / off['subnets_per_s']:.2f}x); "
          f"prefetch hits {on['metrics']['offload/prefetch_hits_stage0']:.0f}, misses "
          f"{on['metrics']['offload/prefetch_misses_stage0']:.0f}, stalled "
          f"{on['metrics']['offload/stall_seconds_stage0']:.3f} s on stage 0")


if __name__ == "__main__":
    main()
