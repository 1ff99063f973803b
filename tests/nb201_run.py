"""Trains the NB201 cell space of examples/nb201_digits.py under NASPipeStrategy; used by test_pipeline.py.

Lightning's subprocess launcher re-runs this script (same arguments) for the other stages. Rank 0
writes a normal checkpoint (collective save).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_lightning as pl  # noqa: E402

import lightning_naspipe as lnp  # noqa: E402
from helpers import load_example, nb201_trainer_kwargs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--balance", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    example = load_example("nb201_digits")
    pl.seed_everything(42, verbose=False)
    model = example.NB201Supernet(channels=4)
    strategy = lnp.NASPipeStrategy(window=args.window, balance=args.balance)
    trainer = pl.Trainer(**nb201_trainer_kwargs(strategy=strategy, devices=args.devices))
    trainer.fit(model, example.DigitsDataModule(batch_size=32))
    trainer.save_checkpoint(args.out)


if __name__ == "__main__":
    main()
