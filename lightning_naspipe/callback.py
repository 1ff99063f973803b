"""The callback that keeps a NASPipe run exact around Lightning's loop.

It checks the run's configuration, steps epoch-interval LR schedulers (Lightning does not under
manual optimization), and stores NASPipe's resume state in the checkpoint. The mixin attaches it
through ``configure_callbacks`` and the strategy adds it if missing, so users need not.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from lightning_naspipe.data import reopen_epoch
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.mixin import NASPipeMixin, supernet_of
from lightning_naspipe.optim import step_schedulers

CHECKPOINT_KEY = "naspipe"


def validate_run(trainer: pl.Trainer, module: object) -> None:
    """Raise :class:`NASPipeConfigError` for settings NASPipe cannot honour exactly.

    Runs before Lightning's own manual-optimization checks, so users get advice that fits NASPipe.
    """
    if not isinstance(module, NASPipeMixin):
        raise NASPipeConfigError(
            f"{type(module).__name__} does not use the NASPipe mixin: declare it as "
            f"class {type(module).__name__}(lightning_naspipe.NASPipeMixin, pytorch_lightning.LightningModule)."
        )
    supernet_of(module)  # raises if self.supernet is missing
    if getattr(module, "automatic_optimization", False):
        raise NASPipeConfigError(
            f"{type(module).__name__} re-enables automatic optimization; NASPipe steps the optimizer once per "
            "subnet itself. Remove the automatic_optimization override."
        )
    if trainer.accumulate_grad_batches != 1:
        raise NASPipeConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: every batch "
            "trains its own subnet, so gradients cannot be accumulated across batches. Use a larger batch_size "
            "instead, and NASPipeStrategy(chunks=...) to split it into micro-batches if memory is tight."
        )
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val > 0:
        raise NASPipeConfigError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) is not supported: norm clipping would "
            "couple subnets and stages. Remove it; to clip, do it per element in your module's "
            "on_before_optimizer_step, e.g. torch.nn.utils.clip_grad_value_(self.parameters(), 1.0), "
            "which stays exact."
        )


class NASPipeCallback(pl.Callback):
    """Keeps LR schedules and resume state exact for NASPipe modules, with or without the strategy."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        validate_run(trainer, pl_module)
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise NASPipeConfigError(
                f"configure_optimizers returned {len(optimizers)} optimizers; NASPipe needs exactly one. "
                "Use parameter groups for different settings."
            )
        supernet_params = {id(p) for p in supernet_of(pl_module).parameters()}
        outside = [
            name
            for name, p in pl_module.named_parameters()
            if id(p) not in supernet_params and any(p is q for g in optimizers[0].param_groups for q in g["params"])
        ]
        if outside:
            raise NASPipeConfigError(
                f"The optimizer holds parameters outside self.supernet ({outside[:3]}...); NASPipe only trains "
                "supernet blocks. Move those modules into a Supernet block (a fixed block is fine)."
            )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_schedulers(trainer.lr_scheduler_configs, "epoch", trainer.current_epoch + 1, trainer.callback_metrics)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state: dict[str, Any] = {"seed": getattr(pl_module, "naspipe_seed", 0)}
        tracker = getattr(trainer.strategy, "data_tracker", None)
        if tracker is not None:
            data = state["data"] = tracker.state_dict()
            if not data["finished"] and trainer.current_epoch > data["epoch"]:
                reopen_epoch(checkpoint, data["epoch"])
        checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if not state:
            return
        pl_module.naspipe_seed = state["seed"]
        tracker = getattr(trainer.strategy, "data_tracker", None)
        if tracker is not None and "data" in state:
            tracker.load_state_dict(state["data"])
