"""Lightning's fit-loop state in a checkpoint, rewritten where Lightning would not resume exactly.

Lightning marks an epoch complete when ``max_steps`` stops training inside it, and resumes a checkpoint
written in the end hooks of an epoch's last batch as the start of the next epoch, skipping that epoch's
validation and end. NASPipe rewrites those checkpoints' loop state (:func:`reopen_epoch`,
:func:`finish_last_window`) so that a resumed run goes on as the uninterrupted one did.

The layout is Lightning's private one: :func:`check_loop_state_layout` fails loudly, naming the Lightning
version, if a release changes it.
"""

from __future__ import annotations

from typing import Any

from lightning_naspipe.compat.lightning import LOGGER_STEP_KEY, SUPPORTED
from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["LOOP_STATE_LAYOUT", "check_loop_state_layout", "epoch_open", "finish_last_window", "reopen_epoch"]


def reopen_epoch(checkpoint: dict[str, Any], epoch: int) -> None:
    """Make a checkpoint's loop state say "epoch ``epoch`` is in progress".

    Lightning marks an epoch complete when ``max_steps`` stops training inside it, and a run
    resumed from such a checkpoint would start the next epoch, skipping the rest of this one.
    Rewritten to the state a checkpoint saved at ``on_train_batch_end`` has, the resumed run
    finishes the epoch exactly as an uninterrupted run would.

    The layout is Lightning's private one: :func:`check_loop_state_layout` fails loudly, naming
    the Lightning version, if a release changes it.
    """
    check_loop_state_layout(checkpoint)
    fit_loop = checkpoint["loops"]["fit_loop"]
    for scope in ("total", "current"):
        counts = fit_loop["epoch_progress"][scope]
        if scope == "current":
            counts.update(ready=epoch + 1, started=epoch + 1, processed=epoch, completed=epoch)
        else:
            extra = counts["completed"] - epoch
            counts.update(ready=counts["ready"] - extra + 1, started=counts["started"] - extra + 1,
                          processed=counts["processed"] - extra, completed=counts["completed"] - extra)
        batches = fit_loop["epoch_loop.batch_progress"][scope]
        batches["completed"] = batches["processed"] - 1
    fit_loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    fit_loop["epoch_loop.state_dict"][LOGGER_STEP_KEY] -= 1
    checkpoint["epoch"] = epoch


def epoch_open(checkpoint: dict[str, Any]) -> bool:
    """Whether a run resumed from ``checkpoint`` goes on with the epoch it was written in (Lightning's
    fit loop had not yet processed it) rather than starting the next one."""
    check_loop_state_layout(checkpoint)
    counts = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
    return bool(counts["processed"] < counts["started"])


def finish_last_window(checkpoint: dict[str, Any], validates: bool) -> None:
    """Make a checkpoint written in the end hooks of an epoch's last window resume into that epoch's end.

    Lightning 2.6 resumes such a checkpoint (last batch trained, epoch not processed) as the start of the
    next epoch: the epoch-end validation and ``on_train_epoch_end`` of this one never run. Rewritten to
    a batch fully completed and, if the epoch ``validates`` at its end, a validation interrupted before
    its first batch, the resumed run validates (from the first batch), ends the epoch and logs at the
    steps the uninterrupted run does. Lightning's private layout, as :func:`reopen_epoch`.
    """
    check_loop_state_layout(checkpoint)
    fit_loop = checkpoint["loops"]["fit_loop"]
    progress = fit_loop["epoch_loop.batch_progress"]
    if any(progress[scope]["completed"] != progress[scope]["processed"] - 1 for scope in ("total", "current")):
        return  # not written in the batch's end hooks
    for scope in ("total", "current"):
        progress[scope]["completed"] = progress[scope]["processed"]
        if validates:
            fit_loop["epoch_loop.val_loop.batch_progress"][scope].update(ready=1, started=1, processed=0,
                                                                        completed=0)
    if not validates:  # Lightning counts this batch for the loggers only when it validates after a restart
        fit_loop["epoch_loop.state_dict"][LOGGER_STEP_KEY] += 1


#: Where reopen_epoch reads and writes in a checkpoint's fit-loop state, as Lightning 2.6 lays it out:
#: (key, scope or None, fields).
_PROGRESS = ("ready", "started", "processed", "completed")
LOOP_STATE_LAYOUT: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("epoch_progress", "total", _PROGRESS), ("epoch_progress", "current", _PROGRESS),
    ("epoch_loop.batch_progress", "total", _PROGRESS), ("epoch_loop.batch_progress", "current", _PROGRESS),
    ("epoch_loop.batch_progress", None, ("is_last_batch",)),
    ("epoch_loop.state_dict", None, (LOGGER_STEP_KEY,)),
    ("epoch_loop.val_loop.batch_progress", "total", _PROGRESS),
    ("epoch_loop.val_loop.batch_progress", "current", _PROGRESS),
)


def check_loop_state_layout(checkpoint: dict[str, Any]) -> None:
    """Raise :class:`NASPipeConfigError` unless the checkpoint's fit-loop state has the layout NASPipe rewrites."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    for key, scope, fields in LOOP_STATE_LAYOUT:
        node = fit_loop.get(key)
        if scope is not None and isinstance(node, dict):
            node = node.get(scope)
        missing = [field for field in fields if not isinstance(node, dict) or field not in node]
        if missing:
            where = f"fit_loop[{key!r}]" + (f"[{scope!r}]" if scope else "")
            raise NASPipeConfigError(
                f"Lightning {checkpoint.get('pytorch-lightning_version', '(unknown version)')} stores the fit loop's "
                f"state differently from the Lightning NASPipe supports ({SUPPORTED}): {where} lacks {missing}. "
                f"NASPipe rewrites that state for exact resume after max_steps; install {SUPPORTED}."
            )
