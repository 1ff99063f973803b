"""Lightning habits as scenarios: each fits ToyNet (or a variant) the way a user would, with a plain Trainer
or under ``NASPipeStrategy``, and returns what must match: the full state and every logged point.

test_usage.py runs them in process (one stage); usage_run.py runs them in several stage processes for
test_usage_stages.py. A scenario that resumes fits twice: into a checkpoint, then from it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from helpers import ToyNet, full_state, pl, toy_loader, trainer_kwargs

#: Makes the strategy of a run (``None``: the plain Trainer).
StrategyFactory = Callable[[], Any]


class Recorder(pl.loggers.Logger):  # type: ignore[misc]
    """Keeps every logged point, to compare a run's metrics with the plain run's."""

    name, version = "recorder", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoaderCrash(Exception):
    """What CrashingLoader raises."""


class CrashingLoader:
    """A training loader that raises when it is read for its ``at``-th batch (counted over epochs)."""

    def __init__(self, at: int) -> None:
        self.loader, self.at, self.read = toy_loader(), at, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            if self.read == self.at:
                raise LoaderCrash(f"the data source failed at batch {self.at}")
            self.read += 1
            yield batch


class PlateauNet(ToyNet):  # type: ignore[misc, valid-type]
    """Lightning's usual ReduceLROnPlateau config: the monitor beside the scheduler."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "epoch"},
                "monitor": "val_loss"}


class OneCycleNet(ToyNet):  # type: ignore[misc, valid-type]
    """OneCycleLR over the whole fit, sized as Lightning's docs show: ``trainer.estimated_stepping_batches``
    (a step more than the fit trains and OneCycleLR raises; one fewer and the cycle is cut short)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


class LoggingNet(ToyNet):  # type: ignore[misc, valid-type]
    """Logs from ``compute_loss``, as users do: a per-step accuracy and an epoch-mean one."""

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        accuracy = (output.argmax(-1) == batch[1]).float().mean()
        if self.trainer.training:
            self.log("train_acc", accuracy)
            self.log("train_acc_mean", accuracy, on_step=False, on_epoch=True, batch_size=len(batch[1]))
        return super().compute_loss(output, batch)


class SkipsRestOfEpoch(ToyNet):  # type: ignore[misc, valid-type]
    """Ends each epoch after 5 batches by returning -1 from on_train_batch_start."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx >= 5 else None


class LogsAtBatchStart(ToyNet):  # type: ignore[misc, valid-type]
    """Logs in ``on_train_batch_start``, as users do: the batch index (on step, the hook's default), a value of
    the batch on step and epoch (its batch size inferred), and one on epoch only with an explicit batch size."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        self.log("batch_idx", float(batch_idx))
        self.log("first_input", batch[0][0, 0], on_epoch=True)
        self.log("idx_mean", float(batch_idx), on_step=False, on_epoch=True, batch_size=3)
        return None


class LogsAtBatchStartAndSkips(LogsAtBatchStart):
    """Also ends each epoch at batch 5 by returning -1, after logging (inside a window of 4)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        super().on_train_batch_start(batch, batch_idx)
        return -1 if batch_idx >= 5 else None


def _host_random_scale(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: noise drawn from Python's and NumPy's global generators inside a block."""
    return output * (1 + 0.1 * random.random() + 0.1 * float(np.random.rand()))


class HostRandomNet(ToyNet):  # type: ignore[misc, valid-type]
    """Randomness outside torch, as users write it: stochastic scaling with ``random.random()`` and
    ``np.random.rand()`` in two blocks (forward hooks run inside the block) and in ``compute_loss``."""

    def __init__(self) -> None:
        super().__init__()
        for block in list(self.supernet.blocks)[1:3]:
            block.register_forward_hook(_host_random_scale)

    def compute_loss(self, output: torch.Tensor, batch: Any, teacher: torch.Tensor | None = None) -> torch.Tensor:
        loss = super().compute_loss(output, batch, teacher)
        return loss * (1 + 0.1 * random.random() + 0.1 * float(np.random.rand()))


class EpochEndWeights(pl.Callback):  # type: ignore[misc]
    """What a user's callback sees of the weights at each epoch's end (a sum per tensor, kept as rows)."""

    def __init__(self) -> None:
        self.sums: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.sums.append({k: float(v.double().sum()) for k, v in pl_module.state_dict().items()})


def fit(strategy: StrategyFactory, loader: Any = None, ckpt_path: Any = None, callbacks: tuple[Any, ...] = (),
        model_class: type | None = None, save_to: Path | None = None, **overrides: Any) -> dict[str, Any]:
    """Fit with validation and a Recorder; the full state and logged rows (a loader crash is caught). With
    ``save_to``, ``trainer.save_checkpoint`` there after fit."""
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    model, logger = (model_class or ToyNet)(), Recorder()
    kwargs = trainer_kwargs(**{"logger": logger, "log_every_n_steps": 1, "callbacks": list(callbacks), **overrides})
    chosen = strategy()
    if chosen is not None:
        kwargs["strategy"] = chosen
        kwargs["devices"] = int(os.environ.get("WORLD_SIZE", 1))  # every stage process of the launch
    trainer = pl.Trainer(**kwargs)
    try:
        # A shuffled validation loader: its permutation comes from the global RNG, as the training loader's.
        trainer.fit(model, loader if loader is not None else toy_loader(), toy_loader(samples=16, shuffle=True),
                    ckpt_path=ckpt_path)
    except LoaderCrash:
        pass
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {**full_state(model, trainer), "rows": logger.rows}


def with_device_stats(strategy: StrategyFactory) -> dict[str, Any]:
    """``DeviceStatsMonitor`` with a stand-in for the device's statistics (no psutil here, and real ones differ run
    to run): the number of readings so far, so the rows say when and how often the monitor read and logged."""
    readings = iter(range(1, 10**6))
    accelerator = pl.accelerators.CPUAccelerator
    own = accelerator.get_device_stats
    accelerator.get_device_stats = lambda self, device: {"readings": float(next(readings))}
    try:
        return fit(strategy, max_epochs=2, log_every_n_steps=3,
                   callbacks=(pl.callbacks.DeviceStatsMonitor(cpu_stats=True),
                              pl.callbacks.LearningRateMonitor(logging_interval="step")))
    finally:
        accelerator.get_device_stats = own


def worker_loader() -> Any:
    """The toy data read by two worker processes (their seeds come from the global RNG each epoch)."""
    loader = toy_loader()
    return torch.utils.data.DataLoader(loader.dataset, batch_size=8, shuffle=True, num_workers=2)


def every_12_steps(folder: Path) -> Any:
    return pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=12, save_top_k=-1, filename="{step}")


def saved_after_fit(folder: Path) -> Any:
    """No callback: the run stops at ``max_steps`` and the script saves a checkpoint after fit."""
    return pl.callbacks.Callback()


#: Resume points: (callback making the checkpoint, loader, file, subnets trained before it, whether the
#: epoch before it had validated). An epoch has 12 batches; a checkpoint in an epoch's last window comes
#: before its validation.
RESUME_POINTS: dict[str, tuple[Callable[[Path], Any], Callable[[], Any] | None, str, int, bool]] = {
    "max_steps inside an epoch, saved after fit": (saved_after_fit, None, "stopped.ckpt", 16, True),
    "max_steps at an epoch's end, saved after fit": (saved_after_fit, None, "stopped.ckpt", 24, True),
    "max_steps inside a window, saved after fit": (saved_after_fit, None, "stopped.ckpt", 10, True),
    "ModelCheckpoint(monitor=val_loss) at validation end": (
        lambda folder: pl.callbacks.ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=-1,
                                                    filename="{epoch}"), None, "epoch=0.ckpt", 12, True),
    "ModelCheckpoint at train epoch end": (
        lambda folder: pl.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1, save_on_train_epoch_end=True,
                                                    filename="{epoch}"), None, "epoch=1.ckpt", 24, True),
    "epoch's last window": (every_12_steps, None, "step=12.ckpt", 12, False),
    "another epoch's last window": (every_12_steps, None, "step=24.ckpt", 24, False),
    "exception at an epoch's first window": (pl.callbacks.OnExceptionCheckpoint, lambda: CrashingLoader(14),
                                             "on_exception.ckpt", 12, True),
    "exception mid-epoch": (pl.callbacks.OnExceptionCheckpoint, lambda: CrashingLoader(21), "on_exception.ckpt",
                            16, True),
    "last.ckpt after a loader crash": (lambda folder: pl.callbacks.ModelCheckpoint(dirpath=folder, save_last=True),
                                       lambda: CrashingLoader(14), "last.ckpt", 12, True),
}


def resumed(strategy: StrategyFactory, point: str, folder: Path) -> dict[str, Any]:
    """Fit into the checkpoint of resume point ``point``, then fit 3 epochs from it."""
    callback, loader, name, step, _ = RESUME_POINTS[point]
    stop = dict(max_steps=step, save_to=folder / name) if callback is saved_after_fit else {}
    fit(strategy, loader() if loader else None, callbacks=(callback(folder),), enable_checkpointing=True,
        max_epochs=3, **stop)
    assert torch.load(folder / name, weights_only=False)["global_step"] == step
    # Resumed with the same kind of loader, as a user does (one that no longer fails).
    return fit(strategy, CrashingLoader(-1) if loader else None, ckpt_path=folder / name, max_epochs=3)


def with_epoch_end_weights(strategy: StrategyFactory) -> dict[str, Any]:
    watcher = EpochEndWeights()
    return {**fit(strategy, callbacks=(watcher,), max_epochs=2), "epoch_end_weights": watcher.sums}


def plain_results(folder: Path, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every scenario of ``names`` (default: all) that does not resume, on a plain Trainer (a resumed one is
    compared with "three epochs", which then runs too)."""
    wanted = set(SCENARIOS if names is None else names)
    if any(name.startswith("resume") for name in wanted):
        wanted.add("three epochs")
    return {name: run(lambda: None, folder / str(k)) for k, (name, run) in enumerate(SCENARIOS.items())
            if name in wanted and not name.startswith("resume")}


def selected_scenarios(request: Any) -> list[str]:
    """The scenarios whose tests of ``request``'s module this pytest session runs (``-k`` runs fewer fits)."""
    return [item.callspec.params["name"] for item in request.session.items
            if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})]


#: Scenarios run the same way on one device and on several stages: name -> run(strategy, folder).
SCENARIOS: dict[str, Callable[[StrategyFactory, Path], dict[str, Any]]] = {
    "three epochs": lambda strategy, folder: fit(strategy, max_epochs=3),
    "limit_train_batches=5": lambda strategy, folder: fit(strategy, max_epochs=2, limit_train_batches=5),
    "limit_train_batches=0.5": lambda strategy, folder: fit(strategy, max_epochs=2, limit_train_batches=0.5),
    "overfit_batches=2": lambda strategy, folder: fit(strategy, max_epochs=2, overfit_batches=2),
    "reload_dataloaders_every_n_epochs=1": lambda strategy, folder: fit(strategy, max_epochs=3,
                                                                        reload_dataloaders_every_n_epochs=1),
    "ReduceLROnPlateau(val_loss)": lambda strategy, folder: fit(strategy, max_epochs=3, model_class=PlateauNet),
    "weights at epoch end": lambda strategy, folder: with_epoch_end_weights(strategy),
    "self.log in compute_loss": lambda strategy, folder: fit(strategy, max_epochs=2, model_class=LoggingNet),
    "random and np.random in blocks and compute_loss": lambda strategy, folder: fit(strategy, max_epochs=2,
                                                                                    model_class=HostRandomNet),
    "LearningRateMonitor": lambda strategy, folder: fit(strategy, max_epochs=2, callbacks=(
        pl.callbacks.LearningRateMonitor(logging_interval="step"),)),
    "OneCycleLR(total_steps=estimated_stepping_batches)": lambda strategy, folder: fit(
        strategy, max_epochs=2, limit_train_batches=10, model_class=OneCycleNet,
        callbacks=(pl.callbacks.LearningRateMonitor(logging_interval="step"),)),
    "LearningRateMonitor, log_every_n_steps=0": lambda strategy, folder: fit(
        strategy, max_epochs=1, log_every_n_steps=0,
        callbacks=(pl.callbacks.LearningRateMonitor(logging_interval="step"),)),
    "DeviceStatsMonitor": lambda strategy, folder: with_device_stats(strategy),
    "precision=64-true": lambda strategy, folder: fit(strategy, max_epochs=1, precision="64-true"),
    "on_train_batch_start returns -1": lambda strategy, folder: fit(strategy, max_epochs=2,
                                                                    model_class=SkipsRestOfEpoch),
    "self.log in on_train_batch_start": lambda strategy, folder: fit(strategy, max_epochs=2,
                                                                     model_class=LogsAtBatchStart),
    "self.log in on_train_batch_start returning -1": lambda strategy, folder: fit(
        strategy, max_epochs=2, model_class=LogsAtBatchStartAndSkips),
    "self.log in on_train_batch_start, max_steps mid-window": lambda strategy, folder: fit(
        strategy, max_epochs=-1, max_steps=15, model_class=LogsAtBatchStart),
    "fast_dev_run=3": lambda strategy, folder: fit(strategy, fast_dev_run=3),
    "log_every_n_steps=5": lambda strategy, folder: fit(strategy, max_epochs=2, log_every_n_steps=5),
    "check_val_every_n_epoch=2": lambda strategy, folder: fit(strategy, max_epochs=3, check_val_every_n_epoch=2),
    "limit_val_batches=1, num_sanity_val_steps=0": lambda strategy, folder: fit(
        strategy, max_epochs=2, limit_val_batches=1, num_sanity_val_steps=0),
    "EarlyStopping(val_loss)": lambda strategy, folder: fit(strategy, max_epochs=6, callbacks=(
        pl.callbacks.EarlyStopping(monitor="val_loss", patience=0),)),
    "min_steps past max_epochs": lambda strategy, folder: fit(strategy, max_epochs=1, min_steps=20),
    "deterministic, detect_anomaly, profiler": lambda strategy, folder: fit(
        strategy, max_epochs=1, deterministic=True, detect_anomaly=True, profiler="simple"),
    "max_steps mid-window": lambda strategy, folder: fit(strategy, max_epochs=-1, max_steps=15),
    "DataLoader(num_workers=2)": lambda strategy, folder: fit(strategy, max_epochs=2, loader=worker_loader()),
    "gradient_clip_val (norm)": lambda strategy, folder: fit(strategy, max_epochs=2, gradient_clip_val=0.2),
    "gradient_clip_val (value)": lambda strategy, folder: fit(strategy, max_epochs=2, gradient_clip_val=0.05,
                                                              gradient_clip_algorithm="value"),
    **{f"resume: {point}": (lambda strategy, folder, point=point: resumed(strategy, point, folder))
       for point in RESUME_POINTS},
}
