"""A once-for-all-style elastic MobileNet on scikit-learn's digits: the sandwich rule with in-place distillation
on 2 pipeline stages, then a search under a FLOPs budget and the best subnet exported (nothing downloaded).

The space (8x8 grayscale digits, 10 classes): a fixed stem (conv 1->16, BN, ReLU), then two units, as
once-for-all's MobileNet has five, each an elastic depth of 1-2 inverted-bottleneck blocks, each block with an
elastic expansion (2x, 3x or 4x: the leading channels of one weight) and an elastic depthwise kernel (3 or 5: the
centre of one 5x5 kernel), then a fixed head (pool, Linear 16->10). A unit is one supernet block, so the stages
split between units. Every candidate is a slice of shared weights, so the subnets of a step conflict on every
block: the pipeline gains from the step's subnets and micro-batches, not from CSP overlap. Run::

    python examples/ofa_digits.py                     # sandwich rule + distillation, 2 stages
    python examples/ofa_digits.py --recipe single     # one uniform subnet per step (SPOS), for comparison
    python examples/ofa_digits.py --devices 1         # the same result on one process, bitwise
    python examples/ofa_digits.py --verify 8          # check 8 steps on 2 stages equal the plain Trainer
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp

EXPANSIONS, KERNELS, CHANNELS, UNITS = (2, 3, 4), (3, 5), 16, 2


def inverted_bottleneck(i: int) -> nn.Module:
    """1x1 expansion (elastic width), depthwise kxk (elastic kernel), 1x1 projection, residual."""
    widths = [CHANNELS * e for e in EXPANSIONS]
    return Residual(nn.Sequential(
        lnp.ElasticConv2d(CHANNELS, widths, 1, bias=False, label=f"expand{i}"),
        lnp.ElasticBatchNorm2d(widths, label=f"expand{i}"), nn.ReLU(),
        lnp.ElasticConv2d(widths, widths, list(KERNELS), bias=False, depthwise=True, in_label=f"expand{i}",
                          kernel_label=f"kernel{i}"),
        lnp.ElasticBatchNorm2d(widths, label=f"expand{i}"), nn.ReLU(),
        lnp.ElasticConv2d(widths, CHANNELS, 1, bias=False, in_label=f"expand{i}"),
        nn.BatchNorm2d(CHANNELS)))


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class ElasticMobileNet(lnp.NASPipeMixin, pl.LightningModule):
    chunks = 2  # micro-batches per subnet, so the stages overlap; the plain Trainer splits alike

    def __init__(self, recipe: str = "sandwich", lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.supernet = lnp.Supernet(
            nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1, bias=False), nn.BatchNorm2d(CHANNELS), nn.ReLU()),
            *(lnp.ElasticDepth([inverted_bottleneck(2 * unit + i) for i in range(2)], depths=[1, 2],
                               label=f"depth{unit}") for unit in range(UNITS)),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 10)),
        )
        self.step_sampler = lnp.Sandwich(2) if recipe == "sandwich" else None

    def compute_loss(self, output: Tensor, batch: Any, teacher: Tensor | None = None) -> Tensor:
        loss = nn.functional.cross_entropy(output, batch[1])
        if teacher is not None:  # in-place distillation from the step's largest subnet
            loss = loss + nn.functional.kl_div(output.log_softmax(-1), teacher.softmax(-1), reduction="batchmean")
        return loss

    def search_metric(self, output: Tensor, batch: Any) -> tuple[Tensor, int]:
        return (output.argmax(-1) == batch[1]).float().sum(), len(batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    train, val = order[:1440], order[1440:]
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, drop_last=True),
            DataLoader(TensorDataset(x[val], y[val]), batch_size=len(val)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("sandwich", "single"), default="sandwich")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--flops", type=int, default=600_000, help="the search's FLOPs budget per sample")
    parser.add_argument("--out", default="runs/ofa_digits")
    parser.add_argument("--verify", type=int, metavar="STEPS", help="instead of training, check that STEPS steps "
                        "on --devices equal the plain Trainer bit for bit (lightning_naspipe.verify)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = ElasticMobileNet(args.recipe)
    train, val = loaders()
    settings = dict(accelerator="cpu", devices=args.devices, max_epochs=args.epochs, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    strategy=lnp.NASPipeStrategy())
    if args.verify is not None:
        report = lnp.verify(model, train, steps=args.verify, **settings)
        print(report.summary())
        sys.exit(report.exit_code)
    trainer = pl.Trainer(**settings)
    trainer.fit(model, train)
    supernet = model.supernet
    calibration = [next(iter(train))]
    result = lnp.search(trainer, model, lnp.RandomSearch(16, seed=1), val, calibration=calibration,
                        max_flops=args.flops)
    smallest = lnp.search(trainer, model, _Fixed(lnp.Sandwich(0).extremes(supernet)[1]), val,
                          calibration=calibration)
    if trainer.is_global_zero:
        scores = [r.score for r in result.history]
        best = result.best_record
        subnet = supernet.freeze(best.architecture)
        folder = lnp.save_subnet(subnet, f"{args.out}/best_subnet_{args.recipe}", next(iter(val))[0][:2],
                                 best.architecture)
        print(f"{args.recipe}: best {best.score:.3f} ({best.architecture}, {best.flops} FLOPs, {best.params} "
              f"parameters; the supernet has {sum(p.numel() for p in supernet.parameters())}), median random "
              f"{statistics.median(scores):.3f}, smallest subnet {smallest.best_record.score:.3f}; "
              f"exported to {folder}")


class _Fixed:
    """A searcher proposing one architecture."""

    def __init__(self, architecture: dict[str, int]) -> None:
        self.architecture = architecture

    def propose(self, labels: Any, history: Any, feasible: Any, maximize: bool) -> list[dict[str, int]]:
        return [] if history else [self.architecture]


if __name__ == "__main__":
    main()
