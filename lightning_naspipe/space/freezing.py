"""One architecture as a standalone module, and its BatchNorm statistics recomputed.

:func:`freeze` copies what one architecture runs out of the supernet: every choice replaced by
its chosen candidate, every :class:`~.choice.When` by its body or by nothing, so no unchosen
weight is copied and no active architecture is needed to run it. Weights tied inside the
architecture stay tied. The result is an ``nn.Sequential`` of the blocks, which passes each
block's output to the next exactly as :meth:`Supernet.forward <.supernet.Supernet.forward>` does,
so its output equals the supernet's for that architecture bitwise. An elastic module
(:class:`~.choice.Elastic`) becomes a smaller plain one holding copies of the slices it uses.

:func:`recalibrate_batchnorm` gives a candidate the statistics it would have had alone: the
supernet's running statistics mix every subnet that trained through a BatchNorm.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_naspipe.compat.torch import BatchNormBase, module_children
from lightning_naspipe.space.choice import ChoiceBlock, Elastic, When

if TYPE_CHECKING:
    from lightning_naspipe.space.supernet import Supernet


class Inactive(nn.Module):
    """What a :class:`~.choice.When` becomes when the frozen architecture does not run its body."""

    def forward(self, *args: object, **kwargs: object) -> None:
        return None


def freeze(supernet: Supernet, architecture: Mapping[str, int], reinitialize: bool = False) -> nn.Sequential:
    """See :meth:`Supernet.freeze <.supernet.Supernet.freeze>`."""
    architecture = supernet.validate(architecture)
    if supernet.local_blocks is not None:
        raise RuntimeError(
            f"This process holds current weights for pipeline stage blocks {supernet.local_blocks.start}.."
            f"{supernet.local_blocks.stop - 1} only (inside fit); freeze after fit, when every stage holds all "
            "weights."
        )
    # deepcopy's memo maps an object's id to its copy: the unchosen parts are never copied.
    blocks = copy.deepcopy(supernet.blocks, _unchosen_memo(list(supernet.blocks), architecture))
    done: dict[int, nn.Module] = {}
    frozen = nn.Sequential(*[_resolve(block, architecture, done) for block in blocks])
    setattr(frozen, "architecture", architecture)  # a plain attribute, read by save_subnet
    if reinitialize:
        for module in frozen.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return frozen.train(supernet.training)


def freeze_block(supernet: Supernet, index: int, architecture: Mapping[str, int]) -> nn.Module:
    """Block ``index`` of ``supernet.freeze(architecture)``, without copying the other blocks: what counting one
    block's parameters and FLOPs needs (on any process: shapes alone decide them)."""
    architecture = supernet.validate(architecture)
    memo = _unchosen_memo(list(supernet.blocks), architecture)
    return _resolve(copy.deepcopy(supernet.blocks[index], memo), architecture, {})


def _is_active(when: When, architecture: Mapping[str, int]) -> bool:
    return architecture[when.label] in when.values


def _unchosen_memo(blocks: list[nn.Module], architecture: Mapping[str, int]) -> dict[int, Any]:
    """A deepcopy memo that stands an :class:`Inactive` in for every module the architecture does not run. A module
    that is unchosen in one place but runs in another (a whole block that is also another choice's candidate) runs."""
    unchosen: list[nn.Module] = []
    active: set[int] = set()
    for block in blocks:
        _collect_unchosen(block, architecture, unchosen)
        _collect_active(block, architecture, active)
    return {id(module): Inactive() for module in unchosen if id(module) not in active}


def _collect_active(module: nn.Module, architecture: Mapping[str, int], out: set[int]) -> None:
    out.add(id(module))
    if isinstance(module, ChoiceBlock):
        assert module.label is not None, "labels are set by the Supernet"
        children: list[nn.Module] = [module.candidates[architecture[module.label]]]
    elif isinstance(module, When):
        children = [module.body] if _is_active(module, architecture) else []
    else:
        children = list(module.children())
    for child in children:
        _collect_active(child, architecture, out)


def _collect_unchosen(module: nn.Module, architecture: Mapping[str, int], out: list[nn.Module]) -> None:
    if isinstance(module, ChoiceBlock):
        assert module.label is not None, "labels are set by the Supernet"
        chosen = architecture[module.label]
        out += [c for i, c in enumerate(module.candidates) if i != chosen]
        _collect_unchosen(module.candidates[chosen], architecture, out)
    elif isinstance(module, When) and not _is_active(module, architecture):
        out.append(module.body)
    else:
        for child in module.children():
            _collect_unchosen(child, architecture, out)


def _resolve(module: nn.Module, architecture: Mapping[str, int], done: dict[int, nn.Module]) -> nn.Module:
    """``module`` with its choices replaced, in place (children), or its replacement. ``done`` maps each
    elastic module already frozen to its replacement, so one reused in two places stays one module."""
    if isinstance(module, ChoiceBlock):
        assert module.label is not None
        return _resolve(module.candidates[architecture[module.label]], architecture, done)
    if isinstance(module, When):
        return _resolve(module.body, architecture, done) if _is_active(module, architecture) else Inactive()
    if id(module) in done:
        return done[id(module)]
    for name, child in list(module_children(module).items()):
        if child is not None:
            module_children(module)[name] = _resolve(child, architecture, done)
    if isinstance(module, Elastic):  # the smaller module with copies of the slices this architecture uses
        done[id(module)] = module.freeze_choice(architecture)
        return done[id(module)]
    return module


def recalibrate_batchnorm(module: nn.Module, batches: Iterable[Any],
                          forward: Callable[[Any], object] | None = None) -> nn.Module:
    """Recompute every BatchNorm's running statistics of ``module`` over ``batches``, in place.

    The statistics become the cumulative mean over the batches (``momentum=None``), with every other
    module in eval mode (so dropout does not change them); ``module`` keeps its train/eval mode, and
    momentum is restored afterwards.

    Args:
        module: e.g. a :meth:`Supernet.freeze <.supernet.Supernet.freeze>` result.
        batches: the calibration inputs; use the same batches for every candidate to compare them fairly.
        forward: how to run one batch (default: ``module(batch)``).

    Returns:
        ``module``.
    """
    norms = [m for m in module.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    if not norms:
        return module
    was_training = module.training
    momenta = [m.momentum for m in norms]
    module.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    run = forward if forward is not None else module
    try:
        with torch.no_grad():
            for batch in batches:
                run(batch)
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        module.train(was_training)
    return module
