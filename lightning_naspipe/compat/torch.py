"""Every private torch name NASPipe reaches, and its one process-wide patch on torch (``clip_grad_norm_``).

Each is guarded, row by row, in ``tests/test_private_apis.py`` (docs/design.md's table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as _pytree
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._foreach_utils import (  # what clip_grad_norm_ itself calls
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

__all__ = ["BatchNormBase", "default_store", "device_has_foreach_support", "foreach_norm",
           "group_tensors_by_device_and_dtype", "has_foreach_support", "module_buffers", "module_children",
           "pytree", "route_clip_grad_functions", "tensor_version"]

#: ``tree_flatten``, ``tree_unflatten``, ``tree_leaves``, ``tree_map``, and a ``TreeSpec`` that pickles.
pytree = _pytree
#: The base of every BatchNorm (and ``SyncBatchNorm``), whatever its dimension.
BatchNormBase = _BatchNorm
group_tensors_by_device_and_dtype = _group_tensors_by_device_and_dtype
has_foreach_support = _has_foreach_support
device_has_foreach_support = _device_has_foreach_support


def foreach_norm(tensors: list[Tensor], norm_type: float) -> list[Tensor]:
    """``torch._foreach_norm``: each tensor's norm, as ``clip_grad_norm_`` computes it."""
    return list(torch._foreach_norm(tensors, norm_type))


def tensor_version(tensor: Tensor) -> int:
    """Autograd's version counter of ``tensor``, raised by every in-place change."""
    return int(tensor._version)


def module_buffers(module: nn.Module) -> dict[str, Tensor | None]:
    """``module``'s own buffer dict, by name (writable: a slot's tensor may be swapped)."""
    return module._buffers


def module_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own child dict, by name (writable: a child may be replaced)."""
    return module._modules


def default_store() -> Any:
    """The default process group's store, or ``None`` (no group, or torch dropped the private getter)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def route_clip_grad_functions(norm: Callable[..., Tensor],
                              value: Callable[..., None]) -> tuple[Callable[..., Tensor], Callable[..., None]] | None:
    """Make ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (and ``nn.utils.clip_grad``'s) ``norm``
    and ``value``; torch's own two, or ``None`` where they already are. A patch, not a hook: torch has none,
    and Lightning, the user and callbacks call these functions by name."""
    utils, module = torch.nn.utils, torch.nn.utils.clip_grad
    if utils.clip_grad_norm_ is norm:
        return None
    original = (utils.clip_grad_norm_, utils.clip_grad_value_)
    for owner in (utils, module):
        setattr(owner, "clip_grad_norm_", norm)
        setattr(owner, "clip_grad_value_", value)
    return original
