"""Does CSP really overlap subnets? Throughput of a wide space on 1 device vs 2 stages.

The space has ``--candidates`` candidates per choice block and no trainable shared block, so
most pairs of subnets are independent on a stage and a window lets them run side by side.
Run from the repository root::

    python benchmarks/overlap.py                 # prints a table of subnets/s and ratios

Each configuration runs in its own processes (one per stage, 1 intra-op thread each) and
measures steady-state training after a warm-up (``common.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp
from common import Result, add_common_args, fit_timed, launch, machine, naspipe_strategy, print_table
from common import ran_as_worker, write_json

#: (label, stages, window)
CONFIGS = [("1 device", 0, 1), ("2 stages, window 1", 2, 1), ("2 stages, window 16", 2, 16)]


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


def wide_loader(samples: int, width: int, batch: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    x = torch.randn(samples, width, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, torch.flip(x, dims=(1,))), batch_size=batch)


def worker(cfg: dict[str, Any]) -> None:
    module = WideSpace(cfg["candidates"], cfg["blocks"], cfg["width"])
    fit_timed(module, wide_loader(cfg["subnets"] * cfg["batch"], cfg["width"], cfg["batch"]), cfg,
              naspipe_strategy(cfg), max(cfg["stages"], 1))


def space_args(parser: argparse.ArgumentParser) -> None:
    """The space's and the run's flags (also used by ``planner_accuracy.py``)."""
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--subnets", type=int, default=480, help="subnets per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=32)


def config(args: argparse.Namespace, stages: int, window: int) -> dict[str, Any]:
    """The worker configuration of one row."""
    keys = ("candidates", "blocks", "width", "batch", "subnets", "warmup")
    return {**{k: getattr(args, k) for k in keys}, "stages": stages, "processes": max(stages, 1), "window": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    space_args(parser)
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    results: dict[str, Result] = {name: launch(__file__, config(args, stages, window), args.repeats)
                                  for name, stages, window in CONFIGS}
    print(f"space: {args.blocks} choice blocks x {args.candidates} candidates, width {args.width}, "
          f"batch {args.batch}; {machine()}")
    print_table([], [(name, "yes", results[name]) for name, _, _ in CONFIGS], [CONFIGS[0][0], CONFIGS[1][0]])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
