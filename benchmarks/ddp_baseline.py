"""What users do today: Lightning DDP with one sampled subnet per rank, vs NASPipe.

The module has no NASPipe mixin: automatic optimization, ``DDPStrategy`` on 2 processes (gloo,
``find_unused_parameters=True``, which a supernet needs because each rank uses other candidates),
each rank samples its own subnet per step from ``(step, rank)`` and DDP averages the gradients.
Compared, on the same character-LM space as ``space_sweep.py``: the plain one-device Trainer
(the sequential reference) and ``NASPipeStrategy`` with CSP on 2 stages.

DDP trains 2 subnets per optimizer step. It is NOT the same training as the sequential run:
every update averages two different subnets' gradients (halving each), steps once, and the
result depends on the number of ranks, so it is not reproducible against one device. Run::

    python benchmarks/ddp_baseline.py             # 32 candidates, default model
    python benchmarks/ddp_baseline.py --quick     # smaller, < 2 min
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor

from common import Result, add_common_args, bar_chart, fit_timed, launch, machine, plot, print_table, ran_as_worker
from common import write_json
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from space_sweep import CharLM, model_args, text_loader

SPACE_SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "space_sweep.py")
SEMANTICS = ("DDP rows are NOT reproducible against the sequential run and train something else: each update\n"
             "averages the gradients of 2 different subnets (one per rank) and steps the optimizer once; the\n"
             "result changes with the number of ranks. Its subnets/s counts both subnets of a step.\n"
             "csp is bitwise the 1-device run.")


class DDPSupernet(pl.LightningModule):
    """The space's supernet trained the usual way: one subnet per rank per step, automatic optimization."""

    def __init__(self, candidates: int, layers: int, width: int, seq: int) -> None:
        super().__init__()
        space = CharLM(candidates, layers, width, seq)
        self.supernet = space.supernet
        self.loss = space.compute_loss  # a bound method, not a submodule: the space's own loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # Each rank draws its own subnet; seeding by (step, rank) keeps runs comparable.
        index = self.global_step * self.trainer.world_size + self.global_rank
        architecture = uniform_architecture(self.supernet.labels, 0, index)
        loss: Tensor = self.loss(self.supernet(self.pipeline_input(batch), architecture), batch)
        return loss

    @staticmethod
    def pipeline_input(batch: Any) -> Tensor:
        x: Tensor = batch[0]
        return x

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def worker(cfg: dict[str, Any]) -> None:
    module = DDPSupernet(cfg["candidates"], cfg["layers"], cfg["width"], cfg["seq"])
    # Lightning's DistributedSampler gives each rank half of the batches: 2 subnets per step.
    data = text_loader(cfg["subnets"] * cfg["batch"], cfg["seq"], cfg["batch"])
    strategy = DDPStrategy(find_unused_parameters=True, process_group_backend="gloo")
    fit_timed(module, data, {**cfg, "warmup": cfg["warmup"] // 2}, strategy, 2, subnets_per_step=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, default=32)
    model_args(parser)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer subnets")
    parser.add_argument("--plot", default="docs/ddp_baseline.png")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    if args.quick:
        args.layers, args.width, args.subnets, args.warmup, args.window = 4, 64, 48, 16, 16
    base = {k: getattr(args, k) for k in ("candidates", "layers", "width", "seq", "batch", "subnets", "warmup",
                                           "window")}
    # Half the blocks per stage: the io embedding + first half of the layers, the rest + io head.
    half = args.layers // 2 + 1
    nas = {**base, "shared_io": False, "schedule": "csp", "chunks": 1, "balance": [half, args.layers + 2 - half]}
    results: dict[str, Result] = {
        "1 device": launch(SPACE_SWEEP, {**nas, "stages": 0, "processes": 1}, args.repeats),
        "DDP 2 ranks": launch(__file__, {**base, "processes": 2}, args.repeats),
        "csp 2 stages": launch(SPACE_SWEEP, {**nas, "stages": 2, "processes": 2}, args.repeats),
    }
    print(f"space: char LM (space_sweep.py), {args.candidates} candidates, {args.layers} layers, width {args.width}, "
          f"batch {args.batch} per subnet; csp window {args.window}; {machine()}")
    print("1 device: plain pl.Trainer() with the NASPipe mixin; DDP: DDPStrategy(find_unused_parameters=True), "
          "no mixin; csp: NASPipeStrategy on 2 stage processes")
    rows = [("1 device", "yes", results["1 device"]), ("DDP 2 ranks", "NO", results["DDP 2 ranks"]),
            ("csp 2 stages", "yes", results["csp 2 stages"])]
    print_table([], rows, ["1 device", "DDP 2 ranks"])
    print(SEMANTICS)
    write_json(args.json, results)

    def render(ax: Any) -> None:
        bar_chart(ax, [r[0] for r in rows], [r[2] for r in rows], results["1 device"], "subnets/s")

    plot(args.plot, render, f"DDP (1 subnet per rank, not reproducible) vs NASPipe CSP, {args.candidates} candidates "
         f"({machine(short=True)})")


if __name__ == "__main__":
    main()
