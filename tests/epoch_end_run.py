"""A many-choice supernet with short epochs, and what a callback sees at each epoch's end; used by
test_callback.py, in process (plain Trainer) and as stage processes (torchrun's variables, 2 stages).

Two fits: in one a callback reads every tensor at each epoch's end (a sync must bring them); in the other the
callback only notes, at each epoch's start, how many tensors the strategy has sent (no reader: none). Rank 0 saves
both results to ``OUT/result``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from helpers import pl  # noqa: E402

WIDTH, CHOICES, BLOCKS, BATCHES = 4, 12, 4, 6


class ManyChoices(lnp.NASPipeMixin, pl.LightningModule):  # type: ignore[misc, name-defined]
    # BatchNorm before the Linear: after it, the Linear's bias would get an exactly zero gradient and keep its
    # value, though the subnet used it (and a sync sends what a subnet used).
    def __init__(self) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(*[
            lnp.ChoiceBlock([nn.Sequential(nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                             for _ in range(CHOICES)]) for _ in range(BLOCKS)])

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Reader(pl.Callback):  # type: ignore[misc, name-defined]
    """Each epoch end: every tensor's value, and how many tensors the strategy's sync sent for it."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.sent: list[int] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.supernet.state_dict().items()})

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.supernet.state_dict().items()})
        self.sent.append(getattr(trainer.strategy, "weights_sent", -1))


class Counter(pl.Callback):  # type: ignore[misc, name-defined]
    """Reads no weights at an epoch's end: notes at each epoch's start how many tensors were sent so far."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.sent.append(getattr(trainer.strategy, "weights_sent", -1))


def fit(devices: int, reader: bool) -> dict[str, Any]:
    pl.seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BATCHES, WIDTH, generator=g)
    callback = Reader() if reader else Counter()
    kwargs: dict[str, Any] = dict(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    if devices > 1:
        kwargs["strategy"] = lnp.NASPipeStrategy(window=2, timeout=60)
    trainer = pl.Trainer(devices=devices, **kwargs)
    model = ManyChoices()
    trainer.fit(model, DataLoader(TensorDataset(x, torch.sin(x)), batch_size=4))
    return {"sent": callback.sent, "states": getattr(callback, "states", []),
            "final": {k: v.clone() for k, v in model.supernet.state_dict().items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {reader: fit(int(os.environ["WORLD_SIZE"]), reader) for reader in (True, False)}
    if os.environ.get("RANK", "0") == "0":
        torch.save(result, Path(args.out) / "result")


if __name__ == "__main__":
    main()
