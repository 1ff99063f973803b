"""Trains the GPT-style space of test_ties.py (a head and a middle block tied to the token embedding) with
Adam and dropout under NASPipeStrategy in this stage process; used by test_ties_stages.py, which starts one
process per stage (torchrun's variables) and runs the plain Trainer on :class:`GPTNet` itself.

Rank 0 writes a normal checkpoint (collective save), the per-subnet training losses and the validation losses.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from helpers import pl, trainer_kwargs  # noqa: E402  # pl: $LNP_TEST_NAMESPACE
from test_ties import LENGTH, VOCAB, gpt  # noqa: E402


class GPTNet(lnp.NASPipeMixin, pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.supernet = gpt(mix_at=3)  # 7 blocks: embedding, 2 layers, a block reading the tied weight, 2, head
        self.losses: dict[int, torch.Tensor] = {}
        self.val_losses: dict[tuple[int, int], torch.Tensor] = {}

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def on_train_subnet_end(self, index: int, architecture: dict[str, int], loss: torch.Tensor) -> None:
        self.losses[index] = loss.clone()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        loss = super().validation_step(batch, batch_idx, dataloader_idx)
        self.val_losses[(self.current_epoch, batch_idx)] = loss.detach().clone()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader(samples: int = 96, shuffle: bool = True) -> DataLoader:
    """Token sequences; shuffled by a generator of its own (validation's loader draws from the global RNG)."""
    tokens = torch.randint(0, VOCAB, (samples, LENGTH + 1), generator=torch.Generator().manual_seed(17))
    order = torch.Generator().manual_seed(23) if shuffle else None
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8, shuffle=shuffle, generator=order)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--balance", default=None, help="blocks per stage, e.g. 3,4")
    parser.add_argument("--num-stages", type=int, default=None, help="fewer than --devices: replicas of each stage")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--move-tied-block", action="store_true",
                        help="3 stages: every window, move block 3 (it reads the tied weight, whose owner stays stage "
                             "0) between the first two stages")
    args = parser.parse_args()
    if args.move_tied_block:
        import lightning_naspipe.integration.stage_placement as placement_module

        def alternate(ranges: list[range], *_: object) -> list[range]:
            split = [range(0, 3), range(3, 5), range(5, 7)]
            return [range(0, 4), range(4, 5), range(5, 7)] if ranges == split else split

        placement_module.rebalanced = alternate  # type: ignore[assignment]
    pl.seed_everything(7, verbose=False)
    model = GPTNet()
    balance = [int(n) for n in args.balance.split(",")] if args.balance else None
    strategy = lnp.NASPipeStrategy(window=args.window, chunks=args.chunks, num_stages=args.num_stages, balance=balance,
                                   timeout=120, rebalance_every=1 if args.move_tied_block else 16)
    trainer = pl.Trainer(**trainer_kwargs(strategy=strategy, devices=args.devices, max_steps=args.max_steps))
    if args.resume:
        model.losses.update(torch.load(args.resume + ".losses", weights_only=False))
    trainer.fit(model, loader(), loader(samples=24, shuffle=False), ckpt_path=args.resume)
    trainer.save_checkpoint(args.out)
    if trainer.global_rank == 0:
        torch.save(model.losses, args.out + ".losses")
        torch.save(model.val_losses, args.out + ".val_losses")
        torch.save(trainer.strategy.stage_ranges, args.out + ".ranges")


if __name__ == "__main__":
    main()
