"""The wire format of a message between stages: one byte buffer per value.

A value (a tensor or a tuple of tensors, any shapes and dtypes) travels as *one* message::

    int64 slots: [DATA, total bytes, header slots, is_tuple, count, (dtype, ndim, *shape) per tensor]
    then each tensor's bytes, every tensor starting at a multiple of ALIGN bytes

One message instead of a header and then one per tensor matters: on a small CPU host each
point-to-point call costs about a millisecond of contended CPU time. The receiver must post a
buffer of the exact size (NCCL requires it), so both ends of a link remember the size of the
link's last message and expect the same again. When a value's size differs, the sender first
sends a :data:`RESIZE` message of the expected size that names the new size. Stage boundaries
carry the same shapes subnet after subnet, so in steady state a value is a single message.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

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


def flatten(value: Any) -> tuple[list[Tensor], bool]:
    """The tensors of a stage-boundary value, and whether it was a tuple."""
    if isinstance(value, Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return list(value), True
    raise TypeError(
        f"A block on a stage boundary returned {type(value).__name__}; blocks must pass a tensor or a tuple of "
        "tensors to the next stage."
    )


def pack(value: Any, device: torch.device) -> Tensor:
    """``value`` as one ``uint8`` buffer on ``device`` (see the module docstring for the layout)."""
    tensors, is_tuple = flatten(value)
    header = [DATA, 0, 0, int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in CODE:
            raise TypeError(f"a stage-boundary tensor has dtype {t.dtype}, which the transport cannot send; "
                            f"use one of {', '.join(str(d) for d in DTYPES)}")
        header += [CODE[t.dtype], t.dim(), *t.shape]
    offsets, total = [], _aligned(_SLOT * len(header))
    for t in tensors:
        offsets.append(total)
        total = _aligned(total + t.numel() * t.element_size())
    header[1], header[2] = total, len(header)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    buffer[: _SLOT * len(header)].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8))
    for t, offset in zip(tensors, offsets):
        _view(buffer, offset, t.dtype, t.shape).copy_(t.detach())
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


def unpack(buffer: Tensor, requires_grad: bool) -> Any:
    """The value :func:`pack` packed; its tensors are views into ``buffer`` (no copy).

    Floating-point tensors require grad when ``requires_grad`` (activations, whose gradient
    the receiving stage sends back).
    """
    slots = int(buffer[2 * _SLOT: 3 * _SLOT].view(torch.int64).item())
    header = buffer[: _SLOT * slots].view(torch.int64).tolist()
    is_tuple, count, pos = bool(header[3]), header[4], 5
    offset = _aligned(_SLOT * slots)
    tensors = []
    for _ in range(count):
        dtype, ndim = DTYPES[header[pos]], header[pos + 1]
        shape = header[pos + 2: pos + 2 + ndim]
        pos += 2 + ndim
        t = _view(buffer, offset, dtype, shape).detach()
        offset = _aligned(offset + t.numel() * t.element_size())
        if requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        tensors.append(t)
    return tuple(tensors) if is_tuple else tensors[0]


def _view(buffer: Tensor, offset: int, dtype: torch.dtype, shape: Any) -> Tensor:
    nbytes = math.prod(int(size) for size in shape) * dtype.itemsize
    return buffer[offset: offset + nbytes].view(dtype).view(tuple(shape))


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN
