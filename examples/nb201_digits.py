"""A NAS-Bench-201 cell space on scikit-learn's digits, trained with NASPipe.

The search space (8x8 grayscale digits, 10 classes, bundled with scikit-learn: nothing is
downloaded)::

    stem (conv 1->C, BN)                                        8x8, C channels
      ─► NB201 cell (C)                                         8x8, C
      ─► reduction (stride-2 conv C->2C, BN, ReLU)              4x4, 2C
      ─► NB201 cell (2C)                                        4x4, 2C
      ─► head (BN, ReLU, global average pool, Linear 2C->10)

An NB201 cell has 4 nodes and 6 edges ``i -> j`` (``i < j``); node ``j`` is the sum of its
incoming edges, the cell's output is node 3. Each edge chooses one of five ops: ``none`` (zeros),
``skip``, ReLU-conv1x1-BN, ReLU-conv3x3-BN, 3x3 average pooling. Both cells use the same labels
``e01 ... e23`` (one architecture is 6 decisions, 5**6 = 15625 subnets, as in NAS-Bench-201) but
separate weights. Each cell is 8 supernet blocks (entry, one per edge, exit), so the pipeline may
split the supernet inside a cell. Every training step samples one subnet uniformly (SPOS) and
updates only that subnet's weights, so ``global_step`` counts subnets.

Run it with the bundled config (two pipeline stages), or on one process::

    python examples/nb201_digits.py fit --config examples/nb201.yaml
    python examples/nb201_digits.py fit --config examples/nb201.yaml --trainer.devices 1

``OMP_NUM_THREADS=1`` helps on a small machine: the tensors are tiny and intra-op threads only
spin-wait on each other.
"""

from __future__ import annotations

from typing import Any, cast

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import ArgsType, LightningCLI
from pytorch_lightning.utilities import rank_zero_info
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_naspipe as lnp  # importing it registers the "naspipe" strategy name
from lightning_naspipe.space.cells import Cell, Zero

NUM_CLASSES = 10
#: Candidate names of every edge, in candidate-index order.
OPS = ("none", "skip", "conv1x1", "conv3x3", "avgpool")


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm on the current batch's statistics (no running averages: under weight sharing they
    would mix many subnets; see examples/digits_spos.py)."""
    return nn.BatchNorm2d(channels, track_running_stats=False)


def relu_conv_bn(channels: int, kernel_size: int) -> nn.Sequential:
    """NB201's conv op. The ReLU is not in place: a node's state feeds several edges."""
    return nn.Sequential(nn.ReLU(), nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, bias=False),
                         batch_norm(channels))


def nb201_op(i: int, j: int, channels: int) -> lnp.ChoiceBlock:
    """Edge ``i -> j``: one of the five NB201 ops, labelled by the edge so that cells share it."""
    return lnp.ChoiceBlock({
        "none": Zero(),
        "skip": nn.Identity(),
        "conv1x1": relu_conv_bn(channels, 1),
        "conv3x3": relu_conv_bn(channels, 3),
        "avgpool": nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
    }, label=f"e{i}{j}")


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 digits as ``(N, 1, 8, 8)`` float images with a fixed train/val split.

    Args:
        batch_size: samples per batch; each training batch trains one subnet.
        val_fraction: share of the 1797 images held out for validation.
        split_seed: seeds the train/val split, whatever the global seed.
        num_workers: DataLoader worker processes (the data is tiny, 0 is fastest).
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, split_seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_workers = num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8), values 0..16
        labels = torch.tensor(digits.target, dtype=torch.long)
        n_val = round(len(labels) * self.val_fraction)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        val_idx, train_idx = order[:n_val], order[n_val:]
        mean, std = images[train_idx].mean(), images[train_idx].std()  # training statistics only
        images = (images - mean) / std
        self.train_set = TensorDataset(images[train_idx], labels[train_idx])
        self.val_set = TensorDataset(images[val_idx], labels[val_idx])

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        assert self.train_set is not None, "setup() runs first"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        assert self.val_set is not None, "setup() runs first"
        # One batch: BatchNorm uses batch statistics, so this keeps validation independent of batching.
        return DataLoader(self.val_set, batch_size=len(self.val_set), shuffle=False, num_workers=self.num_workers)


class NB201Supernet(lnp.NASPipeMixin, pl.LightningModule):
    """The NB201 supernet; training (one sampled subnet per step) is done by the NASPipe mixin.

    Validation scores a fixed panel of ``num_val_subnets`` subnets, ``sample_subnet(-1)``,
    ``sample_subnet(-2)``, ... (negative indices never coincide with a training step), so
    ``val_acc`` (pooled over the panel) is comparable across epochs. Uniform NB201 subnets include
    degenerate ones (``e03``, ``e13``, ``e23`` all ``none``: the cell outputs zeros), so the panel's
    mean sits below its best member; ``val_acc_subnet{i}`` gives each member's accuracy.

    Args:
        channels: width C of the first cell; the second, after the reduction, has 2C.
        lr: Adam's learning rate.
        weight_decay: Adam's (L2) weight decay.
        num_val_subnets: size of the fixed validation panel.
    """

    def __init__(self, channels: int = 16, lr: float = 1e-2, weight_decay: float = 0.0,
                 num_val_subnets: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.weight_decay = weight_decay
        self.num_val_subnets = num_val_subnets
        wide = 2 * channels
        self.supernet = lnp.Supernet(
            nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), batch_norm(channels)),  # stem
            Cell(4, lambda i, j: nb201_op(i, j, channels)),
            nn.Sequential(nn.Conv2d(channels, wide, 3, stride=2, padding=1, bias=False), batch_norm(wide),
                          nn.ReLU()),  # reduction
            Cell(4, lambda i, j: nb201_op(i, j, wide)),  # same labels: the same decisions as the first cell
            nn.Sequential(batch_norm(wide), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(wide, NUM_CLASSES)),  # head
        )
        # What the first block receives for one batch: the strategy balances stages by measured time.
        self.supernet_example_input = torch.zeros(64, 1, 8, 8)
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.val_acc_per_subnet = nn.ModuleList(
            MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro") for _ in range(num_val_subnets)
        )

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def val_architectures(self) -> list[dict[str, int]]:
        """The fixed validation panel (see the class docstring)."""
        return [self.sample_subnet(-1 - i) for i in range(self.num_val_subnets)]

    def on_fit_start(self) -> None:
        for i, architecture in enumerate(self.val_architectures()):
            names = ", ".join(f"{label}={OPS[k]}" for label, k in architecture.items())
            rank_zero_info(f"validation subnet {i}: {names}")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        _, y = batch
        losses = []
        for i, architecture in enumerate(self.val_architectures()):
            # subnet_output runs the subnet through the pipeline when the supernet is split into stages.
            logits = self.subnet_output(batch, architecture)
            losses.append(self.compute_loss(logits, batch))
            self.val_acc.update(logits, y)
            cast(MulticlassAccuracy, self.val_acc_per_subnet[i]).update(logits, y)
        loss = torch.stack(losses).mean()
        self.log("val_loss", loss, batch_size=len(y))
        self.log("val_acc", self.val_acc, prog_bar=True)
        for i in range(self.num_val_subnets):
            self.log(f"val_acc_subnet{i}", cast(MulticlassAccuracy, self.val_acc_per_subnet[i]))
        return loss

    def on_fit_end(self) -> None:
        metrics = self.trainer.callback_metrics
        if "val_acc" in metrics:
            panel = ", ".join(f"{float(metrics[f'val_acc_subnet{i}']):.3f}" for i in range(self.num_val_subnets))
            rank_zero_info(f"final val_acc {float(metrics['val_acc']):.4f} (panel: {panel}) after "
                           f"{self.trainer.global_step} subnets trained")

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def cli_main(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The command-line entry point; ``args`` overrides ``sys.argv`` (used by the tests)."""
    return lnp.naspipe_cli(
        NB201Supernet,
        DigitsDataModule,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
