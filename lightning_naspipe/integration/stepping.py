"""``trainer.estimated_stepping_batches`` under windows: the plain Trainer's value.

Lightning estimates a fit's optimizer steps from ``num_training_batches``, its count of Lightning batches per
epoch. Under ``NASPipeStrategy`` those are windows of a loader that has no length on purpose (:mod:`.data`), so
the count is infinite and Lightning answers ``max_steps``: -1 without one, and
``OneCycleLR(total_steps=self.trainer.estimated_stepping_batches)`` in ``configure_optimizers`` fails inside
torch. A plain run steps once per batch of the user's loader, and so does NASPipe (once per subnet), so the
plain value is Lightning's own rule applied to the user's batches (``limit_train_batches`` and
``overfit_batches`` applied, as the window loader counts them).

:func:`count_subnet_steps` gives the running Trainer that answer for the fit: its class becomes a subclass
(one per Trainer class, the user's own subclasses included) whose property computes it, wherever it is read
(``configure_optimizers``, a ``setup`` hook, a callback) and on every rank, since each rank holds the same
loader. Lightning's property keeps loading the training data when it is read before the fit loop does, so the
data is read when and as a plain run reads it. :func:`stop_counting_subnet_steps` gives the Trainer its own
class back after the fit.
"""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING, Any

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.data import WindowLoader

if TYPE_CHECKING:  # checked against one namespace's Trainer; at run time mixed into either's
    from pytorch_lightning import Trainer as _TrainerBase
else:
    _TrainerBase = object

__all__ = ["count_subnet_steps", "stop_counting_subnet_steps"]


class SubnetSteps(_TrainerBase):
    """Mixed into the running Trainer's class by :func:`count_subnet_steps`."""

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Lightning's estimate, with the user's batches per epoch where Lightning sees windows."""
        estimate: int | float = super().estimated_stepping_batches  # loads the training data where Lightning does
        loader = self.train_dataloader
        if not isinstance(loader, WindowLoader) or self.max_epochs == -1:
            return estimate  # not a NASPipe fit, or Lightning's answer never read the batch count
        return plain_estimate(loader.batch_limit, self.max_epochs, self.max_steps, self.accumulate_grad_batches)


def plain_estimate(batches: int | float, max_epochs: int | None, max_steps: int, accumulate: int) -> int | float:
    """``Trainer.estimated_stepping_batches`` (Lightning 2.6's rule) for ``batches`` per epoch."""
    if batches == math.inf:
        return max_steps
    steps = math.ceil(batches / accumulate) * max(max_epochs or 0, 1)
    return min(steps, max_steps) if max_steps != -1 else steps


#: The counting subclass of each Trainer class, and back.
_COUNTING: dict[type, type] = {}
_ORIGINAL: dict[type, type] = {}


def count_subnet_steps(trainer: Any) -> Any:
    """Make ``trainer.estimated_stepping_batches`` the plain run's (see the module docstring); ``trainer``."""
    cls = type(trainer)
    if cls in _ORIGINAL:
        return trainer
    if cls not in _COUNTING:
        # The Trainer's own name: logs and reprs that name its class stay the same.
        counting = types.new_class(cls.__name__, (SubnetSteps, cls))
        counting.__module__ = __name__
        _COUNTING[cls], _ORIGINAL[counting] = counting, cls
    lightning.swap_class(trainer, _COUNTING[cls])
    return trainer


def stop_counting_subnet_steps(trainer: Any) -> None:
    """Undo :func:`count_subnet_steps` (after the fit; ``None``: nothing to undo): the Trainer pickles and compares
    as its own class again."""
    original = _ORIGINAL.get(type(trainer))
    if original is not None:
        lightning.swap_class(trainer, original)
