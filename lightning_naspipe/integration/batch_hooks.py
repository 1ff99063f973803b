"""The module's ``on_train_batch_start`` under windows: called once per subnet batch, as in a plain run.

Lightning calls the hook once per Lightning batch, which under ``NASPipeStrategy`` is a window of
subnet batches, with the window's index: a hook that returns -1 to end the epoch at batch ``b`` would
count windows. :func:`call_per_subnet_batch` makes the module's hook see each batch of a window with the
``batch_idx`` a plain run gives it, in order, before the window trains. When it returns -1 for batch
``j`` of a window, the window is cut before ``j`` and the epoch ends after it, as the plain run ends
before batch ``j``; the data tracker records the cut, so a checkpoint there resumes into the next epoch.
"""

from __future__ import annotations

from typing import Any

from lightning_naspipe.integration.data import DataTracker

__all__ = ["call_per_subnet_batch"]


def call_per_subnet_batch(module: Any, tracker: DataTracker) -> None:
    """If ``module`` overrides ``on_train_batch_start``, have Lightning's call run it per subnet batch.

    The wrapper is an instance attribute for this fit (:func:`stop_calling_per_subnet_batch` removes it).
    """
    declared = type(module).on_train_batch_start
    if declared is _lightning_default(module):
        return
    ended_in: list[int] = []  # the epoch whose end a hook asked for, while Lightning holds its next window

    def on_train_batch_start(window: list[Any], window_idx: int) -> int | None:
        epoch = module.trainer.current_epoch
        if ended_in == [epoch]:
            return -1  # the window Lightning fetched ahead: the epoch ended before it
        ended_in.clear()
        first = tracker.position()
        for j, batch in enumerate(window):
            if declared(module, batch, first + j) == -1:
                tracker.end_epoch_at(first + j)
                if j == 0:
                    return -1
                del window[j:]
                ended_in.append(epoch)
                return None
        return None

    module.__dict__["on_train_batch_start"] = on_train_batch_start


def stop_calling_per_subnet_batch(module: Any) -> None:
    """Undo :func:`call_per_subnet_batch` (after the fit)."""
    module.__dict__.pop("on_train_batch_start", None)


def _lightning_default(module: Any) -> Any:
    """``LightningModule.on_train_batch_start`` of the module's namespace (the hook's no-op default)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "ModelHooks" and "on_train_batch_start" in vars(cls):
            return vars(cls)["on_train_batch_start"]
    return None
