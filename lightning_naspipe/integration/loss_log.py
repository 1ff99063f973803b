"""A window's training losses logged as the plain Trainer logs them, one subnet at a time.

Under the pipeline strategy one Lightning batch trains a window of subnets. The plain Trainer
(one subnet per batch) logs each subnet's ``train_loss`` once: its loggers get ``train_loss_step``
at step = the subnet's index every ``log_every_n_steps`` subnets, and ``train_loss_epoch`` is the
batch-size-weighted mean over the epoch. :func:`log_window_losses` gives the same series:

- the epoch mean is accumulated subnet by subnet, in the same order and arithmetic as
  ``self.log`` (Lightning's result metric ``value + loss * batch_size``), so it is bitwise equal;
- what the user's ``compute_loss`` logs (on the last stage, recorded and carried to every stage with
  the losses) is logged again in each subnet's turn, through ``self.log``, with that subnet's batch;
- loggers get each subnet's point at its own step, through Lightning's own batch-end logging, and
  Lightning's step counter for loggers (``_batches_that_stepped``) counts subnets, so the window's last
  point, Lightning's own epoch point and every other step-axis value line up with the plain run's.

Cost: a few tensor operations per subnet. ``self.log`` runs once per epoch (it registers the metric
and, at an epoch's first batch, resets it); later windows update the registered metric as ``self.log``
would, without its per-call work (0.5-1.4 ms per call, mostly walking the metric to move it to the
device it is already on), which every stage process paid once per window.

Private Lightning API used, through :mod:`lightning_naspipe.compat.lightning` (see docs/design.md): the result
collection (``update_metrics``, ``batch``, ``batch_size``), the logger connector (``on_batch_start``,
``should_update_logs``, ``update_train_step_metrics``, ``should_reset_tensors``, the hook it logs for), and the
loggers' step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_naspipe.compat import lightning
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import installed

TRAIN_LOSS = "train_loss"


class BatchStartPoints:
    """What per-batch monitors log around each subnet's batch in a plain run, where Lightning calls their hooks
    once per window: ``LearningRateMonitor`` (``logging_interval`` ``"step"`` or ``None``) at each batch start,
    ``DeviceStatsMonitor`` at each batch start and end.

    Called with each subnet's index after its update and scheduler step (:attr:`.Engine.after_update`),
    it takes the LR monitors' points for the next subnet of the window, as they read the optimizer then;
    :func:`log_window_losses` logs them in that subnet's turn (:meth:`log_start`). Device statistics are
    measurements, not results: they are taken in the subnet's turn, at the steps a plain run logs them.

    Args:
        trainer: the running Trainer.
        first, last: the window's first and last subnet index.
        first_batch_idx: the plain run's ``batch_idx`` of the window's first subnet (its place in the epoch).
    """

    def __init__(self, trainer: Any, first: int, last: int, first_batch_idx: int = 0) -> None:
        self.trainer, self.first, self.last, self.first_batch_idx = trainer, first, last, first_batch_idx
        self.monitors = lr_monitors(trainer)
        self.device_monitors = device_monitors(trainer)
        #: Per subnet index, each LR monitor's point (by ``id``) to log at its batch start.
        self.points: dict[int, dict[int, dict[str, float]]] = {}

    def __call__(self, index: int) -> None:
        batch = index + 1
        every = self.trainer.log_every_n_steps
        if not self.first < batch <= self.last or not every or not ((batch + 1) % every == 0
                                                                     or self.trainer.should_stop):
            return  # Lightning's own should_update_logs, for that batch
        for monitor in self.monitors:
            interval = "step" if monitor.logging_interval is None else "any"
            stats = lightning.lr_monitor_stats(monitor, self.trainer, interval)
            if stats:
                self.points.setdefault(batch, {})[id(monitor)] = stats

    def log_start(self, module: Any, index: int, batch: Any) -> None:
        """Subnet ``index``'s batch-start points (not the window's first: Lightning started that batch itself),
        in the order of the Trainer's callbacks, as Lightning calls their hooks."""
        points = self.points.get(index, {})
        for callback in self.trainer.callbacks:
            if id(callback) in points:
                for logger in self.trainer.loggers:
                    logger.log_metrics(points[id(callback)], step=index)
            elif any(callback is monitor for monitor in self.device_monitors):
                # Its own hook: it logs at the loggers' step, which counts subnets here (log_window_losses).
                callback.on_train_batch_start(self.trainer, module, batch, self._batch_idx(index))

    def log_end(self, module: Any, index: int, batch: Any, loss: Tensor) -> None:
        """Subnet ``index``'s batch-end points (not the window's last: Lightning ends that batch itself)."""
        for monitor in self.device_monitors:
            monitor.on_train_batch_end(self.trainer, module, {"loss": loss}, batch, self._batch_idx(index))

    def _batch_idx(self, index: int) -> int:
        return self.first_batch_idx + index - self.first


def lr_monitors(trainer: Any) -> list[Any]:
    """The trainer's ``LearningRateMonitor`` callbacks that log per batch (either namespace)."""
    kinds = tuple(ns.pytorch.callbacks.LearningRateMonitor for ns in installed())
    return [c for c in trainer.callbacks if isinstance(c, kinds) and c.logging_interval != "epoch"]


def device_monitors(trainer: Any) -> list[Any]:
    """The trainer's ``DeviceStatsMonitor`` callbacks (either namespace)."""
    kinds = tuple(ns.pytorch.callbacks.DeviceStatsMonitor for ns in installed())
    return [c for c in trainer.callbacks if isinstance(c, kinds)]


def log_window_losses(module: Any, first_index: int, losses: Sequence[Tensor | None], batches: Sequence[Any],
                      batch_sizes: Sequence[int], records: Sequence[Any] = (),
                      batch_starts: BatchStartPoints | None = None,
                      batch_start_logs: dict[int, list[Any]] | None = None) -> None:
    """Log subnet ``first_index + k``'s ``losses[k]`` (weighted by ``batch_sizes[k]``) and what its
    ``compute_loss`` logged (``records``: ``(index, name, value, args, kwargs)`` of each ``self.log`` call,
    see :class:`~lightning_naspipe.pipeline.runtime.executor.Window`) as the plain Trainer would have in ``first_index
    + k``'s
    own training step, with ``batches[k]`` as the batch; ``None`` losses are skipped. ``batch_starts``: the
    per-batch monitors (:class:`BatchStartPoints`), whose batch-start points come first in a subnet's turn and
    batch-end points before its step metrics. ``batch_start_logs``: what the module's ``on_train_batch_start``
    logged for each subnet but the window's first (:mod:`.batch_hooks`), logged next.

    Call it from ``training_step`` with the whole window.
    """
    trainer = module.trainer
    if trainer.barebones:  # Lightning logs nothing then (self.log only warns)
        return
    if not lightning.has_logging_internals(trainer):
        raise NASPipeConfigError(
            "This Lightning version lays out its training loop differently from what NASPipe knows (no "
            "fit_loop.epoch_loop._batches_that_stepped or trainer._results); install "
            f"{lightning.SUPPORTED}."
        )
    connector, results = lightning.logger_connector(trainer), lightning.results(trainer)
    key = _registered_key(module, trainer)
    if key is not None:
        lightning.set_connector_fx(connector, lightning.current_fx_name(module))  # as self.log leaves it
    logged = [(k, loss) for k, loss in enumerate(losses) if loss is not None]
    by_subnet: dict[int, list[Any]] = {}
    for record in records:
        by_subnet.setdefault(record[0], []).append(record)
    for position, (k, loss) in enumerate(logged):
        index = first_index + k
        if position:  # a batch of its own in the plain run (Lightning started the window's first)
            connector.on_batch_start(batches[k])
        else:
            results.batch, results.batch_size = batches[k], None
        lightning.set_batches_that_stepped(trainer, index)  # the loggers' step axis counts subnets, as in the plain run
        if batch_starts is not None and position:
            batch_starts.log_start(module, index, batches[k])
        log_hook_calls(module, "on_train_batch_start", (batch_start_logs or {}).get(index, ()))
        for _, name, value, args, kwargs in by_subnet.get(index, ()):
            module.log(name, value, *args, **kwargs)
        if key is None:
            module.log(TRAIN_LOSS, loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=batch_sizes[k])
            key = _result_key(results, TRAIN_LOSS)
            if _continue_epoch_sum(module, results[key]):
                results.update_metrics(key, loss, batch_sizes[k])
        else:  # what self.log does for a metric already registered, without its per-call overhead
            results.update_metrics(key, loss, batch_sizes[k])
        # Lightning logs the window's last subnet itself, after training_step; the others here, as it would.
        if position < len(logged) - 1:
            if batch_starts is not None:
                batch_starts.log_end(module, index, batches[k], loss)
            if connector.should_update_logs:
                connector.update_train_step_metrics()
    if key is not None:  # the epoch's running sum so far (Lightning replaces, never changes, these tensors)
        metric = results[key]
        module.__dict__[EPOCH_SUM] = (trainer.current_epoch, metric.value, metric.cumulated_batch_size)


def log_hook_calls(module: Any, hook: str, calls: Sequence[Any]) -> None:
    """``self.log`` each recorded call ``(name, value, args, kwargs)`` as ``hook`` made it: registered under that
    hook, with its defaults (``on_train_batch_start``'s: on step only). Never a batch that starts an epoch (that
    one's calls are Lightning's own), so the hook's metrics are never reset here, at an epoch's end included."""
    if not calls:
        return
    connector = lightning.logger_connector(module.trainer)
    own_hook, fx = lightning.current_fx_name(module), lightning.connector_fx(connector)
    lightning.set_current_fx_name(module, hook)  # (the same hook as before: self.log resets nothing)
    lightning.set_connector_fx(connector, hook)
    try:
        for name, value, args, kwargs in calls:
            module.log(name, value, *args, **kwargs)
    finally:  # as the subnet's training step left them: an epoch's first batch resets a hook's metrics that differ
        lightning.set_current_fx_name(module, own_hook)
        lightning.set_connector_fx(connector, fx)


#: Hooks that run inside a window's backward and updates, on each stage for its own blocks.
STAGE_HOOKS = frozenset({"on_before_backward", "on_after_backward", "on_before_optimizer_step",
                         "configure_gradient_clipping", "on_before_zero_grad", "optimizer_zero_grad"})


def refuse_stage_hook_logging(name: str, hook: str | None) -> None:
    """Refuse ``self.log(name, ...)`` from a hook of :data:`STAGE_HOOKS` while a window trains under the strategy."""
    if hook not in STAGE_HOOKS:
        return
    raise NASPipeConfigError(
        f"self.log({name!r}, ...) in {hook}: under NASPipeStrategy this hook runs inside a window of subnets, on "
        "each stage for its own blocks only (rank 0, which logs, sees its blocks' gradients alone), so the logged "
        "values would differ from the plain Trainer's. Log per subnet from compute_loss (logged in the subnet's own "
        "step) or on_train_subnet_end; a hook that only reads or clips gradients, without logging, is fine."
    )


#: Where a resumed run keeps the checkpoint's running sum behind ``train_loss_epoch`` until it continues it.
RESUMED_SUM = "_naspipe_resumed_loss_sum"
#: ``(epoch, sum, batch count)`` behind ``train_loss_epoch`` after the last logged window.
EPOCH_SUM = "_naspipe_epoch_loss_sum"


def epoch_loss_sum(module: Any, epoch: int) -> dict[str, Tensor] | None:
    """The running sum behind ``train_loss_epoch`` (and its batch count) after the last window of ``epoch``,
    for a checkpoint written inside that epoch: Lightning does not save it (and resets it when ``max_steps``
    stops the epoch), and a run resumed there would average only the subnets after the checkpoint."""
    kept = module.__dict__.get(EPOCH_SUM)
    if kept is None or kept[0] != epoch:
        return None
    return {"value": kept[1].clone(), "cumulated_batch_size": kept[2].clone()}


def _continue_epoch_sum(module: Any, metric: Any) -> bool:
    """Put a resumed run's saved sum (:func:`epoch_loss_sum`) into ``metric``, just registered by this
    epoch's first ``self.log``, so that it goes on from it; whether it did (then log the value again)."""
    saved = module.__dict__.pop(RESUMED_SUM, None)
    if saved is None:
        return False
    metric.value, metric.cumulated_batch_size = saved["value"].clone(), saved["cumulated_batch_size"].clone()
    return True


def finish_resumed_epoch_sum(module: Any, trainer: Any) -> None:
    """At the end of a resumed epoch that trained no subnet after the checkpoint, register the saved sum
    so that Lightning logs ``train_loss_epoch`` as the uninterrupted run does."""
    saved = module.__dict__.get(RESUMED_SUM)
    if saved is None or trainer.barebones:
        return
    hook = lightning.current_fx_name(module)
    lightning.set_current_fx_name(module, "training_step")  # registered as training_step's
    try:
        module.log(TRAIN_LOSS, saved["value"].clone(), prog_bar=True, on_step=True, on_epoch=True, batch_size=1)
    finally:
        lightning.set_current_fx_name(module, hook)
    _continue_epoch_sum(module, lightning.epoch_loop_results(trainer)[f"training_step.{TRAIN_LOSS}"])


def _registered_key(module: Any, trainer: Any) -> str | None:
    """The result key of ``train_loss`` if ``self.log`` would only update it now, else ``None``."""
    fx = lightning.current_fx_name(module)
    # At an epoch's first batch self.log resets the metric first.
    if fx != "training_step" or lightning.logger_connector(trainer).should_reset_tensors(fx):
        return None
    key = f"{fx}.{TRAIN_LOSS}"
    return key if key in lightning.results(trainer) else None


def _result_key(results: Any, name: str) -> str:
    """The result collection's key for metric ``name`` just logged (``"<hook>.<name>"``)."""
    for key, metric in results.items():
        if metric.meta.name == name and key.startswith("training_step."):
            return str(key)
    raise NASPipeConfigError(f"Lightning did not record self.log({name!r}, ...) where NASPipe expects it; "
                             f"install {lightning.SUPPORTED}.")
