"""Block boundaries: every boundary between two blocks is a gradient boundary, in every path.

Why: floating-point sums are not associative. When a tensor crosses a stage cut and is also used
before it, or appears twice in a tuple, autograd inside one graph sums its gradient contributions
in an order that depends on the graph, and so on where the cut is. NASPipe therefore cuts the
autograd graph at *every* block boundary, whether or not a stage boundary falls there:

* forward: block ``b + 1`` receives :func:`cut` of block ``b``'s output: the same structure, each
  tensor detached (one leaf per position, so a tensor that appears twice becomes two leaves), laid
  out as :func:`layout_of` says, requiring grad exactly where the output did;
* backward: block ``b`` runs one ``torch.autograd.backward`` over its own outputs, with the
  gradients its successor's leaves received (``None`` where none arrived: nothing is sent back
  as zeros), and hands its own leaves' gradients on.

Within a stage the hand-off is :func:`cut`; across a stage boundary the transport copies the
same values, layouts, ``requires_grad`` flags and ``None``-ness. Each block's forward and backward
is then the same computation on the same values whatever the partition, and so is the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
from torch import Tensor

from lightning_naspipe.compat.torch import pytree
from lightning_naspipe.space.supernet import BlockValue
CONTIGUOUS, CHANNELS_LAST = 0, 1

#: What crosses a block boundary backwards: one gradient per tensor of the value that requires grad
#: (:func:`grad_targets`), ``None`` where none flowed.
Gradients: TypeAlias = tuple[Tensor | None, ...]


def layout_of(tensor: Tensor) -> int:
    """How a boundary tensor is laid out: channels-last 4-d tensors keep it, all else is contiguous."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return CHANNELS_LAST
    return CONTIGUOUS


def laid_out(tensor: Tensor) -> Tensor:
    """``tensor`` in its boundary layout (no copy when it already is)."""
    if layout_of(tensor) == CHANNELS_LAST or tensor.is_contiguous():
        return tensor
    return tensor.contiguous()


def cut(value: BlockValue) -> BlockValue:
    """``value`` as the next block receives it: every tensor a fresh leaf (see the module docstring)."""
    if isinstance(value, Tensor):  # the common case, without the pytree walk
        return laid_out(value).detach().requires_grad_(value.requires_grad)
    return map_tensors(lambda t: laid_out(t).detach().requires_grad_(t.requires_grad), value)


def map_tensors(fn: Callable[[Tensor], Tensor], value: BlockValue) -> BlockValue:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists, dicts, named tuples)."""
    if isinstance(value, Tensor):
        return fn(value)
    if flat_tensors(value):  # a cell's node states: the same result as the pytree walk, at a fraction of its cost
        return type(value)(fn(v) if v is not None else v for v in value)
    return pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf, value)


def tensors_in(value: BlockValue) -> list[Tensor]:
    """Every tensor in ``value``, in flattening order (a tensor that appears twice, twice)."""
    if isinstance(value, Tensor):
        return [value]
    if flat_tensors(value):
        return [v for v in value if v is not None]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, Tensor)]


def flat_tensors(value: BlockValue) -> bool:
    """Whether ``value`` is a plain tuple or list of tensors and ``None``s (not a subclass: named tuples
    and other registered nodes take the pytree walk)."""
    return type(value) in (tuple, list) and all(v is None or isinstance(v, Tensor) for v in value)


def grad_targets(value: BlockValue) -> list[Tensor]:
    """The tensors of ``value`` that require grad, in flattening order: the positions whose
    gradients cross the boundary backwards."""
    return [t for t in tensors_in(value) if t.requires_grad]


def backward_through(outputs: BlockValue, grads: Sequence[Tensor | None]) -> None:
    """One block's backward: ``grads`` (aligned with :func:`grad_targets` of ``outputs``) into it."""
    targets = grad_targets(outputs)
    if len(targets) != len(grads):
        raise RuntimeError(f"a block boundary got {len(grads)} gradients for {len(targets)} tensors that need one")
    pairs = [(t, g) for t, g in zip(targets, grads) if g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def leaf_grads(inputs: BlockValue) -> Gradients:
    """The gradients a block's input leaves received (``None`` where none flowed), in boundary layout
    as the transport would deliver them (autograd already lays a leaf's gradient out like the leaf)."""
    return tuple(None if t.grad is None else laid_out(t.grad) for t in grad_targets(inputs))


def device_of(value: BlockValue) -> torch.device:
    """The device of the first tensor in ``value`` (CPU when there is none)."""
    for tensor in tensors_in(value):
        return tensor.device
    return torch.device("cpu")
