"""The wire format of a message between stages: one byte buffer per value.

A value (anything a block may pass on: a tensor, a tuple of tensors or ``None``, or any nesting
of tuples, lists and dicts of tensors and plain Python values) travels as *one* message::

    int64 slots: [DATA, total bytes, header slots, kind, count, structure bytes,
                  (dtype or -1 for None, requires_grad, layout, ndim, *shape) per tensor]
    then the pickled structure (kind STRUCTURE only), then each tensor's bytes,
    every part starting at a multiple of ALIGN bytes

``kind`` is TENSOR (a bare tensor), TUPLE (a tuple of tensors and ``None``: the fast path of
tuples between blocks and of gradient messages) or STRUCTURE (anything else: the pytree spec and
the non-tensor leaves are pickled). The receiver gets what :func:`.boundary.cut` would give it
in process: the same structure, values, layout and ``requires_grad`` flags.

One message instead of a header and then one per tensor matters: on a small CPU host each
point-to-point call costs about a millisecond of contended CPU time. Over ``torch.distributed``
(:mod:`.torch_links`) the receiver must post a buffer of the exact size (NCCL requires it), so both
ends of a link remember the size of the link's last message and expect the same again. When a
value's size differs, the sender first sends a :data:`RESIZE` message of the expected size that
names the new size. Shared-memory links (:mod:`.shm_links`) need no such message. Stage boundaries
carry the same shapes subnet after subnet, so in steady state a value is a single message.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_naspipe.compat.torch import pytree
from lightning_naspipe.space.boundary import CHANNELS_LAST, flat_tensors, laid_out, layout_of
from lightning_naspipe.space.supernet import BlockValue

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
DATA, RESIZE = 1, 2
#: Every tensor starts at a multiple of this many bytes, so it can be viewed in place.
ALIGN = 16
#: The size both ends expect for a link's first message: just a ``RESIZE``.
FIRST_SIZE = 16
_SLOT = 8  # bytes per int64 header slot


TENSOR, TUPLE, STRUCTURE = 0, 1, 2
_NONE = -1  # dtype slot of a None entry


class _Slot:
    """Where a tensor leaf stood in a pickled structure."""


def flatten(value: BlockValue) -> tuple[list[Tensor | None], int, bytes]:
    """The tensor entries of a boundary value, its kind, and (kind STRUCTURE) its pickled structure."""
    if isinstance(value, Tensor):
        return [value], TENSOR, b""
    if type(value) is tuple and flat_tensors(value):
        return list(value), TUPLE, b""
    leaves, spec = pytree.tree_flatten(value)
    tensors: list[Tensor | None] = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    others = [_Slot if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    try:
        structure = pickle.dumps((spec, others))
    except Exception as error:
        raise TypeError(
            f"A block on a stage boundary returned a {type(value).__name__} holding a value that cannot be sent "
            f"to the next stage ({error}); pass tensors, tuples, lists, dicts and plain Python values."
        ) from error
    return tensors, STRUCTURE, structure


def pack(value: BlockValue, device: torch.device, allocate: Callable[[int], Tensor] | None = None) -> Tensor:
    """``value`` as one ``uint8`` buffer on ``device`` (see the module docstring for the layout).

    ``allocate(nbytes)``, if given, provides the buffer (e.g. a view of shared memory), so the value is
    written where the receiver reads it."""
    tensors, kind, structure = flatten(value)
    header = [DATA, 0, 0, kind, len(tensors), len(structure)]
    for t in tensors:
        if t is None:
            header += [_NONE, 0, 0, 0]
            continue
        if t.dtype not in CODE:
            raise TypeError(f"a stage-boundary tensor has dtype {t.dtype}, which the transport cannot send; "
                            f"use one of {', '.join(str(d) for d in DTYPES)}")
        header += [CODE[t.dtype], int(t.requires_grad), layout_of(t), t.dim(), *t.shape]
    total = aligned(_SLOT * len(header))
    structure_at = total
    total = aligned(total + len(structure))
    offsets = []
    for t in tensors:
        offsets.append(total)
        if t is not None:
            total = aligned(total + t.numel() * t.element_size())
    header[1], header[2] = total, len(header)
    buffer = allocate(total) if allocate is not None else torch.empty(total, dtype=torch.uint8, device=device)
    buffer[: _SLOT * len(header)].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8))
    if structure:
        buffer[structure_at: structure_at + len(structure)].copy_(torch.frombuffer(bytearray(structure),
                                                                                   dtype=torch.uint8))
    for t, offset in zip(tensors, offsets):
        if t is not None:
            t = laid_out(t.detach())
            _view(buffer, offset, t.dtype, t.shape, layout_of(t)).copy_(t)
    return buffer


def resize_message(expected: int, new_size: int, device: torch.device) -> Tensor:
    """A message of the ``expected`` size telling the receiver that the next one has ``new_size`` bytes."""
    buffer = torch.zeros(expected, dtype=torch.uint8, device=device)
    buffer[:FIRST_SIZE].copy_(torch.tensor([RESIZE, new_size], dtype=torch.int64).view(torch.uint8))
    return buffer


def resized(buffer: Tensor) -> int | None:
    """The announced size if ``buffer`` is a :data:`RESIZE` message, else ``None``."""
    kind, size = buffer[:FIRST_SIZE].view(torch.int64).tolist()
    return int(size) if kind == RESIZE else None


def unpack(buffer: Tensor) -> BlockValue:
    """The value :func:`pack` packed; its tensors are views into ``buffer`` (no copy), requiring
    grad where the sent ones did (activations, whose gradient the receiving stage sends back)."""
    slots = int(buffer[2 * _SLOT: 3 * _SLOT].view(torch.int64).item())
    header = buffer[: _SLOT * slots].view(torch.int64).tolist()
    kind, count, structure_bytes, pos = header[3], header[4], header[5], 6
    structure_at = aligned(_SLOT * slots)
    offset = aligned(structure_at + structure_bytes)
    tensors: list[Tensor | None] = []
    for _ in range(count):
        code, requires_grad, layout, ndim = header[pos: pos + 4]
        shape = header[pos + 4: pos + 4 + ndim]
        pos += 4 + ndim
        if code == _NONE:
            tensors.append(None)
            continue
        t = _view(buffer, offset, DTYPES[code], shape, layout).detach()
        offset = aligned(offset + t.numel() * t.element_size())
        tensors.append(t.requires_grad_(bool(requires_grad)))
    if kind == TENSOR:
        return tensors[0]
    if kind == TUPLE:
        return tuple(tensors)
    spec, others = pickle.loads(buffer[structure_at: structure_at + structure_bytes].cpu().numpy().tobytes())
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if leaf is _Slot else leaf for leaf in others], spec)


def _view(buffer: Tensor, offset: int, dtype: torch.dtype, shape: Any, layout: int) -> Tensor:
    shape = tuple(int(size) for size in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    flat = buffer[offset: offset + nbytes].view(dtype)
    if layout == CHANNELS_LAST:  # memory holds N, H, W, C
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)


def aligned(size: int, align: int = ALIGN) -> int:
    """``size`` rounded up to a multiple of ``align`` (a message's parts, and a shared-memory ring's messages)."""
    return -(-size // align) * align
