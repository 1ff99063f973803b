"""The callback that keeps a NASPipe run exact around Lightning's loop.

:func:`validate_run` checks the run's configuration (the mixin calls it from ``configure_callbacks``,
before Lightning's own, less fitting, advice); :class:`NASPipeCallback` checks the optimizer, steps
epoch-interval LR schedulers (Lightning does not under manual optimization), stores NASPipe's resume
state in the checkpoint and, on an exception, posts it for the other stages to name
(:mod:`~lightning_naspipe.transport.failures`). The mixin attaches it through ``configure_callbacks``.
:class:`StageWeightsSync`, which the strategy puts first in a multi-stage fit, gives every stage every
block's weights at each epoch's end.
"""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from lightning_naspipe.compat.lightning import should_check_val_epoch
from lightning_naspipe.pipeline.exactness.clipping import hide_from_validator, restore
from lightning_naspipe.integration.batch_hooks import log_cut_batch
from lightning_naspipe.integration.loop_state import epoch_open, finish_last_window, reopen_epoch
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.integration.loss_log import RESUMED_SUM, epoch_loss_sum, finish_resumed_epoch_sum
from lightning_naspipe.namespaces import installed, overrides_hook
from lightning_naspipe.pipeline.runtime.optim import step_schedulers
from lightning_naspipe.space.fingerprint import space_changes, space_fingerprint
from lightning_naspipe.space.supernet import supernet_of

CHECKPOINT_KEY = "naspipe"

# Lightning's ModelCheckpoint warns, for every manual-optimization module, that a checkpoint written every n training
# steps holds the weights after the optimizer step unless training_step saved them before it. A NASPipe checkpoint
# at step k is meant to hold them after subnet k's update: a resume continues there with subnet k (windows end at
# checkpoint steps), on one device and on stages alike. So the advice does not apply; ignored, from that module
# only, while a NASPipe run is set up (NASPipeCallback.setup to teardown).
_AFTER_STEP_ADVICE = ("Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
                      "pre-optimization state was saved")
_CHECKPOINT_MODULES = r"(lightning\.pytorch|pytorch_lightning)\.callbacks\.model_checkpoint\Z"

if TYPE_CHECKING:
    from lightning_naspipe.integration.eval_shards import EvalShards
    from lightning_naspipe.pipeline.runtime.engine import Engine


@runtime_checkable
class PipelineRunner(Protocol):
    """What the mixin needs from ``NASPipeStrategy`` (which imports this module, not the other way)."""

    engine: Engine | None
    #: Sharded evaluation over the replicas (see :mod:`.eval_shards`).
    eval_shards: EvalShards

    def report_stages(self) -> None: ...

    def window_trained(self) -> None: ...

    def stage_metrics(self) -> dict[str, float]: ...

    def upcoming_batches(self, first_index: int) -> list[Any] | None: ...


def keep_scheduler_monitors(module: Any, check: Callable[[], object] = lambda: None) -> None:
    """Make the module's next ``configure_optimizers`` call record the ``monitor`` of its LR schedulers.

    Under manual optimization Lightning drops ``monitor`` from scheduler configs (and warns that it is
    ignored), but NASPipe steps ``ReduceLROnPlateau`` itself (:class:`NASPipeCallback`). The wrapper is an
    instance attribute that removes itself on its first call, so nothing stays on the module. ``check`` runs
    first: Lightning calls ``configure_optimizers`` once the module's callbacks are in the Trainer's list and
    before any hook runs training steps (a learning-rate finder swaps the list for its own while it trains).
    """
    declared = type(module).configure_optimizers

    def configure_optimizers() -> Any:
        del module.__dict__["configure_optimizers"]
        check()
        return _take_monitors(declared(module))

    module.__dict__["configure_optimizers"] = configure_optimizers


#: The monitor each LR scheduler was configured with, by scheduler object.
_MONITORS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _take_monitors(config: Any) -> Any:
    """``configure_optimizers``' output without ``monitor`` keys, each recorded in :data:`_MONITORS`."""
    if isinstance(config, (list, tuple)):
        return type(config)(_take_monitors(part) for part in config)
    if not isinstance(config, dict) or "lr_scheduler" not in config:
        return config
    config, monitor = dict(config), config.get("monitor")
    config.pop("monitor", None)
    scheduler = config["lr_scheduler"]
    if isinstance(scheduler, dict):
        scheduler = dict(scheduler)
        monitor = scheduler.pop("monitor", monitor)
        config["lr_scheduler"] = scheduler
    if monitor is not None:
        _MONITORS[scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler] = monitor
    return config


def validate_run(trainer: Any, module: object) -> None:
    """Raise :class:`NASPipeConfigError` for settings NASPipe cannot honour exactly.

    Runs before Lightning's own manual-optimization checks, so users get advice that fits NASPipe.
    """
    supernet_of(module)  # raises if self.supernet is missing
    if not isinstance(trainer.strategy, PipelineRunner) and trainer.world_size > 1:
        raise NASPipeConfigError(
            f"{type(module).__name__} uses the NASPipe mixin under {type(trainer.strategy).__name__} with "
            f"{trainer.world_size} processes: that strategy shards data or gradients in ways that break the "
            "subnet-by-subnet contract (it would train something else silently). Use Trainer(strategy=\"naspipe\", "
            "devices=N) for N pipeline stages, or one device."
        )
    if isinstance(trainer.strategy, PipelineRunner):
        _refuse_batch_counted_triggers(trainer, getattr(trainer.strategy, "window", 1))
        _refuse_finders(trainer)
        _refuse_weight_averaging(trainer)
    if getattr(module, "automatic_optimization", False):
        raise NASPipeConfigError(
            f"{type(module).__name__} re-enables automatic optimization; NASPipe steps the optimizer once per "
            "subnet itself. Remove the automatic_optimization override."
        )
    averaging = [c for c in trainer.callbacks
                 if isinstance(c, tuple(ns.pytorch.callbacks.StochasticWeightAveraging for ns in installed()))]
    if averaging:
        raise NASPipeConfigError(
            "StochasticWeightAveraging is not supported for supernets: it averages every weight of the module each "
            "epoch and then re-trains an epoch with backward skipped to refresh BatchNorm, which needs automatic "
            "optimization; NASPipe steps one subnet at a time. Use it when fine-tuning the exported subnet "
            "(lnp.save_subnet, or supernet.freeze(architecture)) with a plain LightningModule."
        )
    if trainer.accumulate_grad_batches != 1:
        raise NASPipeConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: every batch "
            "trains its own subnet, so gradients cannot be accumulated across batches. Use a larger batch_size "
            "instead, and set chunks on the module (e.g. chunks = 4) to split it into micro-batches if memory is tight."
        )
    # Supported, exactly (clipping.py); Lightning's validator refuses it under manual optimization, so
    # the value stays aside until NASPipeCallback.setup, which runs after the validator.
    hide_from_validator(trainer)


def _refuse_batch_counted_triggers(trainer: Any, window: int) -> None:
    interval = trainer.val_check_interval
    if isinstance(interval, float) and interval != 1.0:
        raise NASPipeConfigError(
            f"Trainer(val_check_interval={interval}) validates after a fraction of an epoch's Lightning batches, "
            f"which are windows of subnets under NASPipeStrategy. Validate per epoch (check_val_every_n_epoch), "
            "or every N subnets with NASPipeStrategy(window=1) and Trainer(val_check_interval=N)."
        )
    if window > 1 and isinstance(interval, int) and not isinstance(interval, bool):
        raise NASPipeConfigError(
            f"Trainer(val_check_interval={interval}) counts Lightning batches, which are windows of "
            f"{window} subnets under NASPipeStrategy, so validation would not run every {interval} "
            "subnets as in a plain run. Validate per epoch (check_val_every_n_epoch), or use "
            "NASPipeStrategy(window=1)."
        )


def _refuse_finders(trainer: Any) -> None:
    """Lightning's learning-rate and batch-size finders under ``NASPipeStrategy``: refused on every rank alike,
    before the stage processes connect (``configure_callbacks`` runs first), so no rank waits for another."""
    for kind, tuner, value, example in (
            ("LearningRateFinder", "lr_find", "learning rate", "model.lr = finder.suggestion()"),
            ("BatchSizeFinder", "scale_batch_size", "batch size", "model.batch_size = the size it returns")):
        classes = tuple(getattr(ns.pytorch.callbacks, kind) for ns in installed())
        if any(isinstance(c, classes) for c in trainer.callbacks):
            raise NASPipeConfigError(
                f"{kind} (the callback, or Tuner(trainer).{tuner}, which adds it) cannot run under NASPipeStrategy: a "
                "finder trains throwaway steps with its own callbacks and step limit in place of the run's, then "
                "restores a checkpoint in the middle of fit, which the stage processes (each holding only its own "
                "blocks, its share of the optimizer state and the window loader's position) cannot follow. Run the "
                "finder with the plain Trainer first (Trainer(strategy=\"auto\", devices=1), the same module and "
                f"data: it trains the same subnets), then fit under NASPipeStrategy with the {value} it found "
                f"(e.g. {example})."
            )


# Lightning's Callback holds no state and only no-op hooks, and Trainers check callbacks by type: one
# class built on both namespaces' Callback serves a Trainer of either.
_CALLBACK_BASES = tuple(ns.pytorch.Callback for ns in installed())


class NASPipeCallback(*_CALLBACK_BASES):  # type: ignore[misc]
    """Keeps LR schedules and resume state exact for NASPipe modules, with or without the strategy.

    ``NASPipeMixin.configure_callbacks`` adds it; a module that overrides ``configure_callbacks``
    must return ``super().configure_callbacks()`` among its callbacks.
    """

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for config in trainer.lr_scheduler_configs:  # the monitors Lightning dropped (keep_scheduler_monitors)
            if config.monitor is None and config.scheduler in _MONITORS:
                config.monitor = _MONITORS[config.scheduler]
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

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        restore(trainer)  # the gradient_clip_val validate_run set aside
        warnings.filterwarnings("ignore", re.escape(_AFTER_STEP_ADVICE), UserWarning, _CHECKPOINT_MODULES)
        self._quiet = warnings.filters[0]  # filterwarnings puts it first

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        quiet = self.__dict__.pop("_quiet", None)
        filters = cast("list[Any]", warnings.filters)  # a list, typed as a Sequence
        if quiet in filters:  # not when a catch_warnings block around the run restored the list
            filters.remove(quiet)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        restore(trainer)
        # Post the error before any exception callback may block, so a stage that lost this one
        # (rank 0 above all, the process the user watches) names the cause, not just the silence.
        strategy = trainer.strategy
        engine = strategy.engine if isinstance(strategy, PipelineRunner) else None
        failures = engine.failures if engine is not None else None
        if failures is not None:
            failures.post(exception)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        log_cut_batch(pl_module)  # before Lightning logs the epoch's metrics
        finish_resumed_epoch_sum(pl_module, trainer)
        step_schedulers(trainer.lr_scheduler_configs, "epoch", trainer.current_epoch + 1, trainer.callback_metrics)

    def on_save_checkpoint(
        self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
    ) -> None:
        state: dict[str, Any] = {"seed": getattr(pl_module, "naspipe_seed", 0),
                                 "space": space_fingerprint(supernet_of(pl_module))}
        tracker = getattr(trainer.strategy, "data_tracker", None)
        if tracker is not None:
            data = state["data"] = tracker.state_dict()
            if not data["finished"] and trainer.current_epoch > data["epoch"]:
                reopen_epoch(checkpoint, data["epoch"])
            data["epoch_open"] = epoch_open(checkpoint)
            if data["epoch_open"]:
                state["train_loss_sum"] = epoch_loss_sum(pl_module, data["epoch"])
            if data["finished"] and data["epoch_open"]:  # whether the epoch validates at its end
                finish_last_window(checkpoint, should_check_val_epoch(trainer))
        checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(
        self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
    ) -> None:
        check_checkpoint_space(trainer, pl_module, checkpoint)  # again: an on_load_checkpoint override may skip it
        state = checkpoint.get(CHECKPOINT_KEY)
        if not state:
            return
        pl_module.naspipe_seed = state["seed"]
        if state.get("train_loss_sum") is not None:  # continued by the resumed epoch's first logged loss
            pl_module.__dict__[RESUMED_SUM] = state["train_loss_sum"]
        tracker = getattr(trainer.strategy, "data_tracker", None)
        if tracker is not None and "data" in state:
            tracker.load_state_dict(state["data"])


def _refuse_weight_averaging(trainer: Any) -> None:
    """Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``) under the strategy."""
    classes = tuple(ns.pytorch.callbacks.WeightAveraging for ns in installed())
    averaging = [type(c).__name__ for c in trainer.callbacks if isinstance(c, classes)]
    if averaging:
        raise NASPipeConfigError(
            f"{averaging[0]} (a WeightAveraging callback) updates its average in on_train_batch_end from the whole "
            "module's weights. Under NASPipeStrategy a Lightning batch is a window of subnets, and on several "
            "stages each process holds current weights for its own blocks only, so the average would differ from "
            "the plain Trainer's. Average the weights with the plain Trainer (exact there: one subnet per batch), "
            "or average saved checkpoints after training (torch.optim.swa_utils.AveragedModel)."
        )


def check_checkpoint_space(trainer: Any, module: Any, checkpoint: Mapping[str, Any]) -> None:
    """Refuse a checkpoint trained on another search space than ``module``'s supernet, naming the differences.

    The mixin's ``on_load_checkpoint`` calls it before Lightning loads the weights (so the differences, not a
    size mismatch, are what the user reads), and :class:`NASPipeCallback` again. Every process of a multi-stage
    run reads the same file and raises alike, before any collective of the run. A checkpoint without a
    fingerprint (written by an earlier release) loads as before; ``validate``/``test``/``predict`` of a module with
    ``strict_loading = False`` load what fits, as Lightning does.

    Raises:
        NASPipeConfigError: the checkpoint's space differs (its choices, candidates, elastic sizes or labels).
    """
    state = checkpoint.get(CHECKPOINT_KEY)
    saved = state.get("space") if isinstance(state, Mapping) else None
    resuming = trainer.state.fn == "fit"
    if saved is None or not (resuming or getattr(module, "strict_loading", True)):
        return
    changes = space_changes(saved, space_fingerprint(supernet_of(module)))
    if not changes:
        return
    path = getattr(trainer, "ckpt_path", None)
    name, shown = type(module).__name__, changes[:6]
    listed = "; ".join(shown) + (f"; and {len(changes) - len(shown)} more" if len(changes) > len(shown) else "")
    if resuming:
        fix = (f"Resuming would train another space without a complaint (tensors of equal shapes load as they are, "
               f"and every subnet sampled from here on differs). Resume with the space the checkpoint was trained "
               f"with; or, to train this space from its weights, start a new run: "
               f"{name}.load_from_checkpoint(path, strict=False), then trainer.fit(model) without ckpt_path (or "
               "start fresh).")
    else:
        fix = (f"Evaluate it with the space it was trained with, or set strict_loading = False on {name} to load "
               "its weights into this space anyway.")
    raise NASPipeConfigError(
        f"The checkpoint{f' {path}' if path else ''} was trained on another search space than {name}'s supernet: "
        f"{listed}. {fix}")


class StageWeightsSync(*_CALLBACK_BASES):  # type: ignore[misc]
    """Put first among the callbacks of a multi-stage fit by ``NASPipeStrategy``: at each epoch's end every
    stage gets the current weights before any other callback or the module's own ``on_train_epoch_end`` reads
    them, as on one device. Between epochs a stage keeps current weights only for its own blocks.

    Only when something can read them (:func:`reads_weights_at_epoch_end`), and only what changed since the
    last sync (``NASPipeStrategy.sync_weights``): a short epoch of a big supernet otherwise pays for more
    messages than training. A checkpoint gathers what it saves itself."""

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if reads_weights_at_epoch_end(trainer, pl_module):
            trainer.strategy.sync_weights()


def reads_weights_at_epoch_end(trainer: Any, module: Any) -> bool:
    """Whether a callback of ``trainer`` or ``module`` itself may read weights in ``on_train_epoch_end``: it
    overrides the hook and is none of Lightning's callbacks known not to read them, or NASPipe's own."""
    if overrides_hook(module, "on_train_epoch_end", ("ModelHooks", "LightningModule")):
        return True
    blind = tuple(cls for ns in installed() for cls in (
        ns.pytorch.callbacks.ProgressBar, ns.pytorch.callbacks.EarlyStopping, ns.pytorch.callbacks.Timer,
        ns.pytorch.callbacks.LearningRateMonitor, ns.pytorch.callbacks.ModelSummary,
        ns.pytorch.callbacks.ModelCheckpoint))  # a checkpoint syncs what it saves (lightning_module_state_dict)
    return any(overrides_hook(c, "on_train_epoch_end", ("Callback", "NASPipeCallback", "StageWeightsSync"))
               for c in trainer.callbacks if not isinstance(c, blind))
