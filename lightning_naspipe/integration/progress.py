"""The training progress bar counts subnets, as a plain Trainer's counts batches.

Lightning's bars count Lightning batches (``batch_idx + 1``), which under NASPipe are windows,
while their total comes from ``max_steps``, which counts subnets: "25% 4/16" at the end of a run.
:func:`count_subnets` makes Lightning's TQDM and Rich bars (and subclasses) count subnets against a
subnet total: the plain run's numbers, updated once per window.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.data import DataTracker
from lightning_naspipe.namespaces import namespace_of

if TYPE_CHECKING:  # checked against one namespace's API; at run time mixed into either's bars
    from pytorch_lightning.callbacks.progress.progress_bar import ProgressBar as _ProgressBarBase
else:
    _ProgressBarBase = object


class SubnetProgress(_ProgressBarBase):
    """Mixed into a progress bar's class by :func:`count_subnets`."""

    _naspipe_tracker: DataTracker

    @property
    @override
    def total_train_batches(self) -> int | float:
        # Lightning's rule (ProgressBar.total_train_batches) in subnets instead of windows.
        trainer = self.trainer
        subnets: int | float = self._naspipe_tracker.epoch_length  # limit_train_batches applied
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            subnets = min(subnets, trainer.max_steps - trainer.global_step)
        return subnets

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The bars show batch_idx + 1 as done: make that the subnets trained this epoch.
        super().on_train_batch_end(trainer, pl_module, outputs, batch, self._naspipe_tracker.position() - 1)


def count_subnets(bar: object, tracker: DataTracker) -> bool:
    """Make ``bar`` (the Trainer's progress bar callback, or None) count subnets; True if it does.

    Only Lightning's own TQDM and Rich bars and their subclasses are changed: other bars may read
    ``batch_idx`` in their own way.
    """
    namespace = namespace_of(bar)
    if bar is None or namespace is None or isinstance(bar, SubnetProgress):
        return isinstance(bar, SubnetProgress)
    progress = namespace.pytorch_module("callbacks.progress")
    if not isinstance(bar, (progress.TQDMProgressBar, progress.RichProgressBar)):
        return False
    bar_class = type(bar)
    if bar_class not in _COUNTING:
        _COUNTING[bar_class] = types.new_class(f"SubnetCounting{bar_class.__name__}", (SubnetProgress, bar_class))
    lightning.swap_class(bar, _COUNTING[bar_class])
    bar._naspipe_tracker = tracker
    return True


_COUNTING: dict[type, type] = {}
