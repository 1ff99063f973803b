"""The Lightning half of gradient clipping under NASPipe: each subnet's optimizer step calls
``configure_gradient_clipping`` where Lightning's precision plugin clips under automatic optimization
(``Precision._clip_gradients``, after the ``on_before_optimizer_step`` hooks). The engine's
:class:`~lightning_naspipe.pipeline.exactness.clipping.UpdateClipping` runs it around each step; the pipeline imports no
Lightning, so the glue hands it over when it builds an engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_naspipe.compat.lightning import has_clip_gradients, replaced_clip_gradients
from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["lightning_clipping"]


@contextlib.contextmanager
def lightning_clipping(module: Any) -> Iterator[None]:
    """Lightning's automatic-optimization call to ``configure_gradient_clipping`` for one optimizer step (the engine's
    :data:`~lightning_naspipe.pipeline.exactness.clipping.ClippingHook`)."""
    plugin = module.trainer.precision_plugin
    if not has_clip_gradients(plugin):
        raise NASPipeConfigError(_LIGHTNING_CHANGED.format(type(plugin).__name__, "has no _clip_gradients"))
    calls = []

    def clip_gradients(model: Any, optimizer: Any, clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
        calls.append(optimizer)
        model.configure_gradient_clipping(optimizer, gradient_clip_val=clip_val,
                                          gradient_clip_algorithm=gradient_clip_algorithm)

    with replaced_clip_gradients(plugin, clip_gradients):  # this instance only, for this step
        yield
    if not calls:
        raise NASPipeConfigError(_LIGHTNING_CHANGED.format(type(plugin).__name__,
                                                           "did not call _clip_gradients in the optimizer step"))


_LIGHTNING_CHANGED = (
    "Gradient clipping under NASPipe runs configure_gradient_clipping where Lightning's precision plugin clips under "
    "automatic optimization (Precision._clip_gradients, after the on_before_optimizer_step hooks), but {} {}: this "
    "Lightning version changed that private API. Remove gradient_clip_val and the configure_gradient_clipping "
    "override, or use a Lightning version lightning_naspipe supports.")
