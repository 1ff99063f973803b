"""SPOS-style supernet search on scikit-learn's digits, trained with NASPipe.

The search space is a small CNN for the 8x8 grayscale digits (10 classes, bundled with
scikit-learn, so nothing is downloaded)::

    stem (conv 1->C, BN, ReLU)                                  8x8, C channels
      ─► 2 × ChoiceBlock                                        8x8, C
      ─► reduction (stride-2 conv C->2C, BN, ReLU)              4x4, 2C
      ─► 2 × ChoiceBlock                                        4x4, 2C
      ─► head (global average pool, Linear 2C->10)

Each ChoiceBlock picks one of four shape-preserving candidates: a 3x3 conv, a 5x5 conv, a
depthwise-separable 3x3 conv (all with BatchNorm and ReLU), or a skip (``nn.Identity``). Stem,
reduction and head are fixed blocks trained by every subnet. Every training step samples one
subnet uniformly (single-path one-shot, SPOS) and updates only that subnet's weights, so
``global_step`` counts subnets.

Run it with the bundled config (two pipeline stages), or pick the strategy on the command line::

    python examples/digits_spos.py fit --config examples/digits.yaml
    python examples/digits_spos.py fit --trainer.strategy naspipe --trainer.max_epochs 3

After ``fit``, search the trained supernet under a FLOPs budget (the same config plus the search's
own settings) and fine-tune the best subnet with a plain Trainer::

    python examples/digits_spos.py search --config examples/digits.yaml --config examples/digits_search.yaml
    python examples/digits_finetune.py

Without ``--trainer.strategy naspipe`` the plain one-device Trainer trains the very same
subnets, bitwise identically, one per batch.

The tensors are tiny, so torch's intra-op threads buy nothing; on a machine whose cores are busy
with other work, ``OMP_NUM_THREADS=1`` avoids threads spin-waiting on each other.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import ArgsType
from lightning.pytorch.utilities import rank_zero_info
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_naspipe as lnp  # importing it registers the "naspipe" strategy name

NUM_CLASSES = 10
#: Candidate names of every ChoiceBlock, in candidate-index order.
CANDIDATES = ("conv3x3", "conv5x5", "sepconv3x3", "skip")


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm that always normalises with the current batch's statistics.

    Why no running statistics: under weight sharing a block's input distribution depends on
    which candidates run before it, so running averages mix many subnets and mislead the
    evaluation of any single one (SPOS recalibrates them per subnet for that reason). With
    ``track_running_stats=False`` validation normalises with the validation batch instead,
    which is deterministic here because the whole validation set is one fixed batch.
    """
    return nn.BatchNorm2d(channels, track_running_stats=False)


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Sequential:
    """A 'same'-padded conv (no bias: BatchNorm follows), BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False),
        batch_norm(out_channels),
        nn.ReLU(inplace=True),
    )


def separable_conv(channels: int, kernel_size: int = 3) -> nn.Sequential:
    """Depthwise conv followed by a pointwise (1x1) conv, BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=False),
        nn.Conv2d(channels, channels, 1, bias=False),
        batch_norm(channels),
        nn.ReLU(inplace=True),
    )


def choice_block(channels: int) -> lnp.ChoiceBlock:
    """One searchable layer: four candidates that all keep the input's ``(N, C, H, W)`` shape."""
    return lnp.ChoiceBlock(
        {
            "conv3x3": conv_bn_relu(channels, channels, 3),
            "conv5x5": conv_bn_relu(channels, channels, 5),
            "sepconv3x3": separable_conv(channels, 3),
            # Parameter-free, so it conflicts with no other subnet in the pipeline schedule.
            "skip": nn.Identity(),
        }
    )


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 digits as ``(N, 1, 8, 8)`` float images with a fixed train/val split.

    Args:
        batch_size: samples per batch; each training batch trains one subnet.
        val_fraction: share of the 1797 images held out for validation.
        split_seed: seeds the train/val split, so it is the same in every run whatever the
            global seed.
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
        # A generator of its own: the split must not depend on (or consume) the global RNG.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        val_idx, train_idx = order[:n_val], order[n_val:]
        # Normalise with training-split statistics only, so validation stays held out.
        mean, std = images[train_idx].mean(), images[train_idx].std()
        images = (images - mean) / std
        self.train_set = TensorDataset(images[train_idx], labels[train_idx])
        self.val_set = TensorDataset(images[val_idx], labels[val_idx])

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        assert self.train_set is not None, "setup() runs first"
        # Shuffling draws from torch's global RNG; NASPipe records it per epoch for exact resume.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        assert self.val_set is not None, "setup() runs first"
        # One batch holding the whole validation set: BatchNorm normalises with batch statistics
        # (see ``batch_norm``), so this keeps validation results independent of batching.
        return DataLoader(self.val_set, batch_size=len(self.val_set), shuffle=False, num_workers=self.num_workers)


class DigitsSupernet(lnp.NASPipeMixin, pl.LightningModule):
    """The SPOS supernet; training (one sampled subnet per step) is done by the NASPipe mixin.

    Validation scores a fixed panel of ``num_val_subnets`` subnets, ``sample_subnet(-1)``,
    ``sample_subnet(-2)``, ...: negative indices never coincide with a training step, and since
    sampling is a pure function of ``(naspipe_seed, index)`` the panel is the same at every
    validation of a run, so ``val_acc`` is comparable across epochs. ``val_acc`` and ``val_loss``
    are pooled over the panel (each subnet sees the whole validation set, so that is the panel's
    mean); ``val_acc_subnet{i}`` gives each panel member's accuracy.

    Args:
        channels: width C of the 8x8 blocks; the 4x4 blocks after the reduction have 2C.
        blocks_per_stage: ChoiceBlocks at each of the two resolutions.
        lr: Adam's initial learning rate.
        weight_decay: Adam's (L2) weight decay.
        lr_step_epochs: multiply the learning rate by ``lr_gamma`` every this many epochs.
        lr_gamma: the learning-rate decay factor.
        num_val_subnets: size of the fixed validation panel.
    """

    def __init__(self, channels: int = 16, blocks_per_stage: int = 2, lr: float = 1e-2, weight_decay: float = 0.0,
                 lr_step_epochs: int = 15, lr_gamma: float = 0.5, num_val_subnets: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()  # LightningCLI also records them in the run's config.yaml
        self.lr = lr
        self.weight_decay = weight_decay
        self.lr_step_epochs = lr_step_epochs
        self.lr_gamma = lr_gamma
        self.num_val_subnets = num_val_subnets
        wide = 2 * channels
        self.supernet = lnp.Supernet(
            conv_bn_relu(1, channels, 3),  # stem
            *(choice_block(channels) for _ in range(blocks_per_stage)),
            # A fixed reduction, as in SPOS: a wider, coarser map lets the pooled head see where strokes are.
            conv_bn_relu(channels, wide, 3, stride=2),
            *(choice_block(wide) for _ in range(blocks_per_stage)),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(wide, NUM_CLASSES)),  # head
        )
        # What the first block receives for one batch of 8x8 digit images: with several stages, the
        # strategy times each block on it and splits the stages by time rather than parameter counts.
        self.supernet_example_input = torch.zeros(64, 1, 8, 8)
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.val_acc_per_subnet = nn.ModuleList(
            MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro") for _ in range(num_val_subnets)
        )

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def search_metric(self, output: Tensor, batch: Any) -> tuple[Tensor, int]:
        """What ``search`` scores a subnet by: correct predictions and the count (integers sum exactly)."""
        return (output.argmax(dim=1) == batch[1]).sum(), len(batch[1])

    def val_architectures(self) -> list[dict[str, int]]:
        """The fixed validation panel (see the class docstring)."""
        return [self.sample_subnet(-1 - i) for i in range(self.num_val_subnets)]

    def on_fit_start(self) -> None:
        for i, architecture in enumerate(self.val_architectures()):
            names = ", ".join(f"{label}={CANDIDATES[k]}" for label, k in architecture.items())
            rank_zero_info(f"validation subnet {i}: {names}")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        _, y = batch
        losses = []
        for i, architecture in enumerate(self.val_architectures()):
            # subnet_output rather than self.supernet(x, architecture): it also works when the
            # supernet is split into pipeline stages, each holding current weights for its blocks only.
            logits = self.subnet_output(batch, architecture)
            losses.append(self.compute_loss(logits, batch))
            self.val_acc.update(logits, y)
            self._subnet_acc(i).update(logits, y)
        loss = torch.stack(losses).mean()
        self.log("val_loss", loss, batch_size=len(y))
        # Logging the metric objects lets torchmetrics compute the epoch value over all batches.
        self.log("val_acc", self.val_acc, prog_bar=True)
        for i in range(self.num_val_subnets):
            self.log(f"val_acc_subnet{i}", self._subnet_acc(i))
        return loss

    def _subnet_acc(self, i: int) -> MulticlassAccuracy:
        # An nn.ModuleList (so the metrics follow the module's device) only knows it holds Modules.
        return cast(MulticlassAccuracy, self.val_acc_per_subnet[i])

    def on_fit_end(self) -> None:
        # LightningCLI prints no summary after fit; tell the user where the run ended up.
        val_acc = self.trainer.callback_metrics.get("val_acc")
        if val_acc is not None:
            rank_zero_info(f"final val_acc (mean over {self.num_val_subnets} validation subnets): "
                           f"{float(val_acc):.4f} after {self.trainer.global_step} subnets trained")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        # Optimization is manual under NASPipe; its callback steps "epoch" schedulers at each epoch end.
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.lr_step_epochs, gamma=self.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def cli_main(args: ArgsType = None, run: bool = True) -> Any:
    """The command-line entry point; ``args`` overrides ``sys.argv`` (used by the tests)."""
    # LightningCLI plus a "search" subcommand that reads the same config file as "fit" (or the
    # config.yaml fit saved in its log folder: search saves its own as search_config.yaml).
    return lnp.naspipe_cli(
        DigitsSupernet,
        DigitsDataModule,
        seed_everything_default=42,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
