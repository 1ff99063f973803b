"""The loggers get one training loss per subnet, at its step, exactly as from the plain Trainer."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from pytorch_lightning.loggers import CSVLogger

import lightning_naspipe as lnp
from helpers import ToyNet, pl, toy_loader, train

LOGGED = ("train_loss_step", "train_loss_epoch", "val_loss")


def logged_rows(log_dir: Path) -> list[tuple[str, str, str, str]]:
    """``(step, epoch, metric, value)`` for every logged training and validation loss, in file order."""
    with open(log_dir / "metrics.csv") as f:
        return [(r["step"], r["epoch"], key, r[key]) for r in csv.DictReader(f) for key in LOGGED if r.get(key)]


def run_logged(tmp_path: Path, name: str, strategy: object, every: int) -> list[tuple[str, str, str, str]]:
    train(strategy, max_epochs=2, logger=CSVLogger(tmp_path / name, name="", version=""), log_every_n_steps=every,
          loader=toy_loader(), val_loader=toy_loader(samples=40, shuffle=False))
    return logged_rows(tmp_path / name)


@pytest.mark.parametrize(("window", "every"), [(5, 1), (5, 3), (4, 50)])
def test_pipelined_run_logs_the_plain_series(tmp_path: Path, window: int, every: int) -> None:
    plain = run_logged(tmp_path, "plain", None, every)
    piped = run_logged(tmp_path, "piped", lnp.NASPipeStrategy(window=window), every)
    steps = [int(step) for step, _, key, _ in plain if key == "train_loss_step"]
    assert steps == [s for s in range(24) if (s + 1) % every == 0]  # 12 subnets per epoch, 2 epochs
    assert any(key == "train_loss_epoch" for _, _, key, _ in plain)
    assert piped == plain


def test_comparison_sees_a_shifted_step(tmp_path: Path) -> None:
    plain = run_logged(tmp_path, "plain", None, 1)
    shifted = [(str(int(step) + 1), epoch, key, value) for step, epoch, key, value in plain]
    assert shifted != plain and len(set(shifted)) == len(set(plain))


def test_self_log_runs_once_per_epoch_and_the_metrics_match_the_plain_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from pytorch_lightning import LightningModule

    calls: list[tuple[int, int]] = []
    original = LightningModule.log

    def counted(self: LightningModule, name: str, *args: object, **kwargs: object) -> None:
        if name == "train_loss":
            calls.append((self.trainer.current_epoch, self.trainer.global_step))
        original(self, name, *args, **kwargs)  # type: ignore[arg-type]

    _, plain = train(None, max_epochs=2, loader=toy_loader(), val_loader=toy_loader(samples=40, shuffle=False))
    monkeypatch.setattr(LightningModule, "log", counted)
    _, piped = train(lnp.NASPipeStrategy(window=4), max_epochs=2, loader=toy_loader(),
                     val_loader=toy_loader(samples=40, shuffle=False))
    assert calls == [(0, 4), (1, 16)]  # 3 windows of 4 subnets per epoch: after the first of each epoch only
    for metrics in ("callback_metrics", "progress_bar_metrics", "logged_metrics"):
        ours, theirs = getattr(piped, metrics), getattr(plain, metrics)
        assert ours.keys() == theirs.keys() and all(
            torch.equal(torch.as_tensor(ours[k]), torch.as_tensor(theirs[k])) for k in ours), metrics


class _LogsInBackward(ToyNet):  # type: ignore[misc, valid-type]
    def on_after_backward(self) -> None:
        self.log("seen_backward", 1.0)


class _LogsGradients(pl.Callback):  # type: ignore[misc, name-defined]
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pl_module.log("grad_sum", sum(float(p.grad.sum()) for p in pl_module.parameters() if p.grad is not None))


def test_logging_from_a_backward_or_optimizer_hook_is_refused_under_the_strategy_and_kept_plain() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=r"self.log\('seen_backward', ...\) in on_after_backward.*"
                                                     r"compute_loss"):
        train(lnp.NASPipeStrategy(window=2), model_cls=_LogsInBackward, max_epochs=1)
    with pytest.raises(lnp.NASPipeConfigError, match=r"'grad_sum', ...\) in on_before_optimizer_step"):
        train(lnp.NASPipeStrategy(window=2), max_epochs=1, callbacks=[_LogsGradients()])
    _, trainer = train(None, model_cls=_LogsInBackward, max_epochs=1, callbacks=[_LogsGradients()])
    assert {"seen_backward", "grad_sum"} <= set(trainer.callback_metrics)  # the plain Trainer: exact, allowed
