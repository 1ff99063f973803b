"""The training progress bar counts subnets against a subnet total, as a plain Trainer's does."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl

import lightning_naspipe as lnp
from helpers import train
from lightning_naspipe.integration.progress import SubnetProgress, count_subnets


def _recording_bar(namespace: Any) -> Any:
    class Recording(namespace.callbacks.TQDMProgressBar):  # type: ignore[misc, name-defined]
        """Lightning's bar, recording (done, total) as each epoch ends."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[int, int]] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            self.seen.append((self.train_progress_bar.n, self.train_progress_bar.total))

    return Recording()


BOTH = [pytest.param(L, id="lightning.pytorch"), pytest.param(pl, id="pytorch_lightning")]
LIMITS = [dict(max_steps=16, max_epochs=-1), dict(max_epochs=2), dict(max_steps=17, max_epochs=-1)]


@pytest.mark.parametrize("namespace", BOTH)
@pytest.mark.parametrize("limits", LIMITS,
                         ids=["max_steps", "max_epochs", "max_steps-mid-window"])
def test_bar_shows_the_plain_runs_counts(namespace: Any, limits: dict[str, int]) -> None:
    plain_bar, naspipe_bar = _recording_bar(namespace), _recording_bar(namespace)
    train(namespace=namespace, enable_progress_bar=True, callbacks=[plain_bar], **limits)
    _, trainer = train(lnp.NASPipeStrategy(window=5), namespace=namespace, enable_progress_bar=True,
                       callbacks=[naspipe_bar], **limits)
    assert isinstance(trainer.progress_bar_callback, SubnetProgress)
    assert naspipe_bar.seen == plain_bar.seen and plain_bar.seen  # e.g. [(12, 12), (4, 4)] for max_steps=16


def test_limit_train_batches_counts_batches_as_in_a_plain_run_and_the_bar_says_so() -> None:
    bar = _recording_bar(L)
    train(lnp.NASPipeStrategy(window=4), namespace=L, enable_progress_bar=True, callbacks=[bar], max_epochs=1,
          limit_train_batches=6)
    assert bar.seen == [(6, 6)]  # 6 batches (a window of 4 subnets and one of 2), not 6 windows


def test_other_bars_are_left_alone() -> None:
    class Custom(L.callbacks.ProgressBar):  # type: ignore[misc]
        pass

    bar = Custom()
    assert not count_subnets(bar, None) and type(bar) is Custom  # type: ignore[arg-type]
    assert not count_subnets(None, None)  # type: ignore[arg-type]
