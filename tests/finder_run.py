"""Fits ToyNet under NASPipeStrategy with a learning-rate or batch-size finder, as a user's script would; used by
test_finders.py. Lightning's subprocess launcher re-runs this script (same arguments) for the other stages.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from helpers import pl, trainer_kwargs  # noqa: E402  # pl: $LNP_TEST_NAMESPACE
from test_finders import SizedNet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finder", choices=["LearningRateFinder", "BatchSizeFinder", "lr_find", "scale_batch_size"])
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    callbacks = [getattr(pl.callbacks, args.finder)()] if args.finder[0].isupper() else []
    # A timeout longer than the test's hang protection: a stage that waits for the other fails the test.
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=4, timeout=600), devices=args.devices,
                                          callbacks=callbacks, max_epochs=1))
    if callbacks:
        trainer.fit(SizedNet())
    else:
        getattr(pl.tuner.Tuner(trainer), args.finder)(SizedNet())


if __name__ == "__main__":
    main()
