"""The module's ``on_train_batch_start`` under windows: called once per subnet batch, as in a plain run.

Lightning calls the hook once per Lightning batch, which under ``NASPipeStrategy`` is a window of
subnet batches, with the window's index: a hook that returns -1 to end the epoch at batch ``b`` would
count windows. :func:`call_per_subnet_batch` makes the module's hook see each batch of a window with the
``batch_idx`` a plain run gives it, in order, before the window trains. When it returns -1 for batch
``j`` of a window, the window is cut before ``j`` and the epoch ends after it, as the plain run ends
before batch ``j``; the data tracker records the cut, so a checkpoint there resumes into the next epoch.
Batches past ``max_steps`` are not shown to it: the plain run stops before them.

What the hook logs with ``self.log`` is logged as in a plain run too. Its call for the window's first batch
runs where Lightning calls the hook, so it logs there. Its calls for the later batches run before the window
trains, where logging would overwrite the first batch's values (every step of the window would log the last
one); they are recorded instead (:func:`recording_log`) and logged in their subnet's turn, after the window,
by :func:`.loss_log.log_window_losses`. The call that returns -1 logs what no step of the plain run logs
(its epoch aggregates only): it is logged at the epoch's end, before Lightning logs the epoch's metrics
(:func:`log_cut_batch`).
"""

from __future__ import annotations

from typing import Any

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.data import DataTracker
from lightning_naspipe.integration.loss_log import log_hook_calls

__all__ = ["call_per_subnet_batch", "log_cut_batch", "recorded_logs", "recording_log"]

#: While the hook runs for a later batch of a window: the list its ``self.log`` calls are recorded in.
_RECORDING = "_naspipe_batch_start_recording"
#: The recorded calls of the window about to train, by subnet index: ``[(name, value, args, kwargs)]``.
_RECORDED = "_naspipe_batch_start_logs"
#: The batch and calls of the hook's call that returned -1 in a window's middle, logged at the epoch's end.
_CUT = "_naspipe_batch_start_cut"
#: The hook whose ``self.log`` calls these are.
HOOK = "on_train_batch_start"


def call_per_subnet_batch(module: Any, tracker: DataTracker) -> None:
    """If ``module`` overrides ``on_train_batch_start``, have Lightning's call run it per subnet batch.

    The wrapper is an instance attribute for this fit (:func:`stop_calling_per_subnet_batch` removes it).
    """
    declared = type(module).on_train_batch_start
    if declared is _lightning_default(module):
        return
    ended_in: list[int] = []  # the epoch whose end a hook asked for, while Lightning holds its next window

    def on_train_batch_start(window: list[Any], window_idx: int) -> int | None:
        trainer = module.trainer
        epoch = trainer.current_epoch
        if ended_in == [epoch]:
            return -1  # the window Lightning fetched ahead: the epoch ended before it
        ended_in.clear()
        first, step = tracker.position(), trainer.global_step
        recorded: dict[int, list[Any]] = {}
        module.__dict__[_RECORDED] = recorded
        # The plain run stops at max_steps, before its next batch starts (the window is cut there to train).
        shown = window if trainer.max_steps < 0 else window[:max(1, trainer.max_steps - step)]
        for j, batch in enumerate(shown):
            calls = recorded.setdefault(step + j, []) if j else None
            module.__dict__[_RECORDING] = calls
            try:
                answer = declared(module, batch, first + j)
            finally:
                module.__dict__.pop(_RECORDING, None)
            if answer == -1:
                tracker.end_epoch_at(first + j)
                if j == 0:
                    return -1
                module.__dict__[_CUT] = (batch, recorded.pop(step + j))
                del window[j:]
                ended_in.append(epoch)
                return None
        return None

    module.__dict__["on_train_batch_start"] = on_train_batch_start


def recording_log(module: Any) -> list[Any] | None:
    """Where ``module``'s ``self.log`` calls go now (``None``: logged as usual)."""
    calls: list[Any] | None = module.__dict__.get(_RECORDING)
    return calls


def recorded_logs(module: Any) -> dict[int, list[Any]]:
    """The calls recorded for the window about to train, by subnet index (taken: the next window records anew)."""
    calls: dict[int, list[Any]] = module.__dict__.pop(_RECORDED, {})
    return calls


def log_cut_batch(module: Any) -> None:
    """At the epoch's end: log what the hook logged in the call that returned -1 in a window's middle (the plain
    run logs it after its last step, into the epoch's aggregates only), with that call's batch."""
    cut = module.__dict__.pop(_CUT, None)
    if cut is None:
        return
    batch, calls = cut
    results = lightning.results(module.trainer)
    results.batch, results.batch_size = batch, None
    log_hook_calls(module, HOOK, calls)


def stop_calling_per_subnet_batch(module: Any) -> None:
    """Undo :func:`call_per_subnet_batch` (after the fit)."""
    for name in ("on_train_batch_start", _RECORDING, _RECORDED, _CUT):
        module.__dict__.pop(name, None)


def _lightning_default(module: Any) -> Any:
    """``LightningModule.on_train_batch_start`` of the module's namespace (the hook's no-op default)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "ModelHooks" and "on_train_batch_start" in vars(cls):
            return vars(cls)["on_train_batch_start"]
    return None
