"""Fine-tune the subnet that ``digits_spos.py search`` exported, with a plain Lightning Trainer.

The exported folder holds the architecture and the subnet's weights; the subnet is rebuilt with
``Supernet.freeze`` (the supernet's shape comes from the training checkpoint's hyperparameters)
and the exported weights are loaded into it. The Trainer is the plain one-device Trainer: the
subnet is an ordinary ``nn.Sequential``, no NASPipe involved::

    python examples/digits_finetune.py                       # runs/digits/best_subnet
    python examples/digits_finetune.py --from-scratch        # same architecture, new weights

It prints the validation accuracy before and after fine-tuning.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from digits_spos import DigitsDataModule, DigitsSupernet
from lightning_naspipe.searching.export import WEIGHTS_FILE, load_architecture


class SubnetClassifier(pl.LightningModule):
    """A standalone subnet trained as any classifier.

    Args:
        net: the subnet.
        lr: Adam's learning rate.
    """

    def __init__(self, net: nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def rebuild(folder: Path, checkpoint: Path, from_scratch: bool = False) -> nn.Module:
    """The exported subnet as a trainable module: its architecture, with the exported weights."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["hyper_parameters"]
    hparams = {k: v for k, v in saved.items() if not k.startswith("_")}  # LightningCLI adds "_instantiator"
    net = DigitsSupernet(**hparams).supernet.freeze(load_architecture(folder), reinitialize=from_scratch)
    if not from_scratch:
        net.load_state_dict(torch.load(folder / WEIGHTS_FILE, map_location="cpu"))
    return net


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Fine-tune and return the validation accuracy before and after."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subnet", type=Path, default=Path("runs/digits/best_subnet"))
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/digits/supernet.ckpt"))
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--from-scratch", action="store_true", help="re-initialise the weights first")
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    model = SubnetClassifier(rebuild(args.subnet, args.checkpoint, args.from_scratch), args.lr)
    data = DigitsDataModule()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    before = float(trainer.validate(model, data, verbose=False)[0]["val_acc"])
    trainer.fit(model, data)
    after = float(trainer.validate(model, data, verbose=False)[0]["val_acc"])
    print(f"{'re-initialised' if args.from_scratch else 'exported'} subnet {load_architecture(args.subnet)}: "
          f"val_acc {before:.4f} before, {after:.4f} after {args.epochs} epochs")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
