"""Gradient clipping, as Lightning does it under automatic optimization, exact on any number of stages.

Under automatic optimization Lightning's precision plugin runs, per optimizer step: the closure,
the ``on_before_optimizer_step`` hooks, then ``configure_gradient_clipping`` (by default
``self.clip_gradients`` with the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``:
``torch.nn.utils.clip_grad_norm_`` or ``clip_grad_value_`` over the optimizer's parameters), then the
step. NASPipe optimizes manually (one step per subnet), so Lightning skips the clipping call and its
configuration validator refuses ``gradient_clip_val``. This module restores that order per subnet:

* :func:`hide_from_validator` and :func:`restore`: the Trainer's ``gradient_clip_val`` is ``None`` only
  while Lightning validates the run (between the mixin's ``configure_callbacks`` and the callback's
  ``setup``), so the manual-optimization check passes and every hook sees the real value.
* :class:`UpdateClipping`, around each subnet's optimizer step (inside ``optim.restrict_param_groups``,
  so the optimizer holds that subnet's parameters only): the precision plugin's ``_clip_gradients``
  calls ``configure_gradient_clipping`` as it does under automatic optimization. On several stages,
  ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (Lightning's, the user's, any callback's)
  see only that subnet's gradients on the stage, and a norm is the global one of :mod:`.grad_norm`,
  exchanged with the other stages; without a planned exchange (:func:`clips_by_norm`) a norm clip is
  refused, since each stage alone holds only its own gradients.

Private Lightning API: ``Precision._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)``,
the call in ``Precision._after_closure`` (after the hooks, before the step) that returns at once under
manual optimization. :class:`UpdateClipping` shadows it on the plugin instance for one step and fails
the step loudly if Lightning did not call it; ``tests/test_clipping.py`` guards both namespaces.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_naspipe.compat.torch import route_clip_grad_functions
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.exactness.grad_norm import NormExchange, StageNorms, local_norms
from lightning_naspipe.namespaces import namespace_of
from lightning_naspipe.pipeline.runtime.optim import flat_positions

__all__ = ["ClippingHook", "UpdateClipping", "clips", "clips_by_norm", "hide_from_validator", "install", "restore"]

#: ``hook(module)``: a context around one optimizer step in which the module's Trainer calls
#: ``configure_gradient_clipping`` where its precision plugin clips under automatic optimization.
ClippingHook = Callable[[Any], contextlib.AbstractContextManager[None]]

_HIDDEN: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def hide_from_validator(trainer: Any) -> None:
    """Set ``trainer.gradient_clip_val`` aside until :func:`restore`: Lightning's configuration validator
    refuses it under manual optimization, and NASPipe clips itself (see the module docstring)."""
    value = trainer.gradient_clip_val
    if value is not None and value > 0:
        _HIDDEN[trainer] = value
        trainer.gradient_clip_val = None


def restore(trainer: Any) -> None:
    """Give ``trainer`` back the ``gradient_clip_val`` :func:`hide_from_validator` set aside."""
    if trainer in _HIDDEN:
        trainer.gradient_clip_val = _HIDDEN.pop(trainer)


def clips(module: Any, by_norm: bool = False) -> bool:
    """Whether the module's optimizer steps may clip (with ``by_norm``: by a norm): ``Trainer(gradient_clip_val
    > 0)`` (with the ``"norm"`` algorithm, the default), or an override of ``configure_gradient_clipping``."""
    trainer = module.trainer
    value = getattr(trainer, "gradient_clip_val", None)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    by_trainer = value is not None and value > 0 and (not by_norm or algorithm in (None, "norm"))
    return by_trainer or _overrides_clipping(type(module))  # type: ignore[arg-type]  # classes hash


def clips_by_norm(module: Any) -> bool:
    """Whether the module's optimizer steps may clip by a norm (see :func:`clips`): on several stages the
    schedule then plans a norm exchange in every update."""
    return clips(module, by_norm=True)


@cache
def _overrides_clipping(module_class: type) -> bool:
    namespace = namespace_of(module_class)
    if namespace is None:  # not a LightningModule (the engine's tests)
        return False
    own = getattr(module_class, "configure_gradient_clipping", None)
    return own is not namespace.pytorch.LightningModule.configure_gradient_clipping


class UpdateClipping:
    """How one stage's updates clip in a window.

    Args:
        stage: this stage.
        num_stages: how many stages the pipeline has.
        exchange: ``exchange(subnet)``: the norm exchange of that subnet's update; ``None`` if the
            window's schedule plans none (a norm clip on several stages is then refused).
        hook: Lightning's automatic-optimization clipping call around one optimizer step, given by the Lightning
            glue (``integration/precision_clipping.py``); ``None`` where no Trainer clips (the engine alone).
    """

    def __init__(self, stage: int, num_stages: int, exchange: Callable[[int], NormExchange] | None,
                 hook: ClippingHook | None = None) -> None:
        self.stage, self.num_stages, self.exchange, self.hook = stage, num_stages, exchange, hook

    @contextlib.contextmanager
    def step(self, module: Any, optimizer: Optimizer, params: list[Tensor], index: int) -> Iterator[None]:
        """Around subnet ``index``'s optimizer step, before ``optimizer`` is restricted to ``params``."""
        hook = self.hook if getattr(module.trainer, "precision_plugin", None) is not None and clips(module) else None
        update = None
        if self.num_stages > 1:
            install()
            exchange = self.exchange(index) if self.exchange is not None else None
            positions = flat_positions(optimizer, params) if exchange is not None else {}
            update = _Update(self.stage, self.num_stages, index, optimizer, {id(p) for p in params}, positions,
                             exchange)
            _ACTIVE.update = update
        try:
            with hook(module) if hook is not None else contextlib.nullcontext():
                yield
        finally:
            _ACTIVE.update = None
        if update is not None and update.exchange is not None and not update.exchanged:
            update.exchange.agree(StageNorms(self.stage))  # every update exchanges once: the others may clip




_ACTIVE = threading.local()  # the update in progress on this thread (stage threads share a process in tests)


class _Update:
    """One subnet's optimizer step on one stage of several: what torch's clipping functions may touch."""

    def __init__(self, stage: int, num_stages: int, index: int, optimizer: Optimizer, own: set[int],
                 positions: dict[int, int], exchange: NormExchange | None) -> None:
        self.stage, self.num_stages, self.index, self.optimizer = stage, num_stages, index, optimizer
        self.own, self.positions, self.exchange = own, positions, exchange
        self.exchanged = False

    def clip_norm(self, parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float,
                  error_if_nonfinite: bool, foreach: bool | None) -> Tensor:
        if self.exchange is None:
            raise NASPipeConfigError(
                f"torch.nn.utils.clip_grad_norm_ ran in subnet {self.index}'s optimizer step on stage {self.stage} "
                f"of {self.num_stages}, outside configure_gradient_clipping: each stage holds only its own blocks' "
                "gradients, so its norm would not be the one-device norm. Use Trainer(gradient_clip_val=..., "
                "gradient_clip_algorithm=\"norm\"), or clip in an override of configure_gradient_clipping: NASPipe "
                "then exchanges the gradient norms between stages and clips exactly as one device does.")
        if self.exchanged:
            raise NASPipeConfigError(
                f"clip_grad_norm_ ran twice in subnet {self.index}'s optimizer step: on several stages NASPipe "
                "exchanges one global norm per step. Clip once, e.g. with Trainer(gradient_clip_val=...) or in "
                "configure_gradient_clipping, not also in on_before_optimizer_step.")
        self.exchanged = True
        listed = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        restricted = [p for group in self.optimizer.param_groups for p in group["params"]]
        by_optimizer = len(listed) == len(restricted) and all(p is q for p, q in zip(listed, restricted))
        # Only this subnet's gradients: another subnet in flight here may hold some of its own already.
        mine = [(n, p) for n, p in enumerate(listed) if id(p) in self.own and p.grad is not None]
        norm_type = float(norm_type)
        with torch.no_grad():
            norms = local_norms([p.grad for _, p in mine if p.grad is not None], norm_type, foreach)
            record = StageNorms.local(self.stage, [(self.positions.get(id(p), -1), n) for n, p in mine], norms,
                                      by_optimizer=by_optimizer, length=len(listed), max_norm=float(max_norm),
                                      norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
            total = self.exchange.agree(record)
            assert total is not None, "this stage clipped, so the verdict is a total or an error"
            if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                    "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                    "anyway, set `error_if_nonfinite=False`")
            torch.nn.utils.clip_grads_with_norm_([p for _, p in mine], max_norm, total, foreach)
        return total

    def clip_value(self, parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None) -> None:
        listed = [parameters] if isinstance(parameters, Tensor) else parameters
        mine = [p for p in listed if id(p) in self.own and p.grad is not None]
        if mine:  # torch's raises on no gradients at all, which one device never meets (the loss has some)
            _TORCH["value"](mine, clip_value, foreach)


_TORCH: dict[str, Any] = {}  # torch's own functions, as install() found them


def _clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    update: _Update | None = getattr(_ACTIVE, "update", None)
    if update is None:
        return _TORCH["norm"](parameters, max_norm, norm_type, error_if_nonfinite, foreach)  # type: ignore[no-any-return]
    return update.clip_norm(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None = None) -> None:
    update: _Update | None = getattr(_ACTIVE, "update", None)
    if update is None:
        _TORCH["value"](parameters, clip_value, foreach)
    else:
        update.clip_value(parameters, clip_value, foreach)


def install() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` through NASPipe during a
    subnet's update on several stages (elsewhere they call torch's own). Idempotent; a name imported
    before this (``from torch.nn.utils import clip_grad_norm_``) keeps torch's function."""
    originals = route_clip_grad_functions(_clip_grad_norm_, _clip_grad_value_)
    if originals is None:
        return
    _TORCH.update(norm=originals[0], value=originals[1])
    _clip_grad_norm_.__doc__, _clip_grad_value_.__doc__ = _TORCH["norm"].__doc__, _TORCH["value"].__doc__
