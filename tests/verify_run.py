"""A toy module checked by ``verify``: ``python verify_run.py api [--rank-dependent] [--steps N]`` calls
:func:`lightning_naspipe.verify`; ``python verify_run.py <LightningCLI arguments>`` is a ``naspipe_cli`` script (its
``verify`` subcommand). ``rank_dependent`` scales the loss by ``1 + LOCAL_RANK``: on 2 stages the loss is computed
on rank 1, so the pipelined run differs from the plain one from its first step."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

import lightning_naspipe as lnp  # noqa: E402
from helpers import ToyBody, toy_loader  # noqa: E402


class VerifyNet(ToyBody, pl.LightningModule):
    def __init__(self, rank_dependent: bool = False, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.rank_dependent = rank_dependent

    def compute_loss(self, output: torch.Tensor, batch: Any, teacher: torch.Tensor | None = None) -> torch.Tensor:
        loss = super().compute_loss(output, batch, teacher)
        return loss * (1 + int(os.environ.get("LOCAL_RANK", "0"))) if self.rank_dependent else loss

    def train_dataloader(self) -> Any:
        return toy_loader()


def api(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-dependent", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    pl.seed_everything(3, verbose=False)
    model = VerifyNet(args.rank_dependent)
    report = lnp.verify(model, steps=args.steps, strategy=lnp.NASPipeStrategy(window=4), devices=2,
                        accelerator="cpu", max_epochs=3, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False)
    print(report.summary())
    return report.exit_code


if __name__ == "__main__":
    if sys.argv[1:2] == ["api"]:
        sys.exit(api(sys.argv[2:]))
    lnp.naspipe_cli(VerifyNet)
