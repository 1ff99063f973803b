"""The mechanism under offloading: which copy a resource's tensors point at, and async copies.

A resource's parameters, buffers and optimizer state are switched between a host copy and a
device copy by pointing ``param.data`` (and the buffer slots and optimizer state entries) at one
or the other, so the model, the optimizer and checkpoints always see the current values, and
copies are bitwise exact. Copies to the device run on a side CUDA stream, or on CPU on a
background thread into a separate pool of tensors (the same mechanism, only plain memcpy).

What to copy when (the budget, eviction, prefetch) is :mod:`.offload`'s and :mod:`.residency`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_naspipe.compat.torch import module_buffers
from lightning_naspipe.space.supernet import ResourceState

#: What an asynchronous copy hands back: done when it is.
Ready = Future[None] | torch.cuda.Event


def nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class SwappedResource:
    """One resource's tensor slots, and its host copy.

    Attributes:
        params: its parameters.
        buffers: per buffer tensor, every ``(module, name)`` slot holding it (tied buffers stay one tensor).
        host: the host copies, in the order of :meth:`tensors`.
    """

    params: list[torch.nn.Parameter]
    buffers: list[list[tuple[torch.nn.Module, str]]]
    host: list[Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, state: ResourceState) -> SwappedResource:
        slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for m, n in state.buffers:
            slots.setdefault(id(module_buffers(m)[n]), []).append((m, n))
        return cls(params=list(state.params), buffers=list(slots.values()))

    def tensors(self, optimizer: Optimizer | None) -> list[Tensor]:
        """The current tensors: parameters, buffers, then optimizer state, in a fixed order."""
        out: list[Tensor] = [p.data for p in self.params]
        out += [module_buffers(group[0][0])[group[0][1]] for group in self.buffers]  # type: ignore[misc]
        for p in self.params:
            out += [v for _, v in _state_items(optimizer, p)]
        return out

    def point_to(self, tensors: list[Tensor], optimizer: Optimizer | None) -> None:
        """Make ``tensors`` (in the order of :meth:`tensors`) the current ones."""
        it = iter(tensors)
        for p in self.params:
            p.data = next(it)
        for group in self.buffers:
            tensor = next(it)
            for m, n in group:
                module_buffers(m)[n] = tensor
        for p in self.params:
            state = optimizer.state[p] if optimizer is not None and p in optimizer.state else {}
            for k, _ in _state_items(optimizer, p):
                state[k] = next(it)

    def move_to_host(self, optimizer: Optimizer | None, pin: bool) -> None:
        """Fresh host copies of the current tensors become current (e.g. just loaded from a checkpoint)."""
        host = [t.detach().to("cpu") for t in self.tensors(optimizer)]
        self.host = [t.pin_memory() for t in host] if pin else host
        self.point_to(self.host, optimizer)

    def write_back(self, optimizer: Optimizer | None, pin: bool) -> None:
        """Copy the current (device) tensors into the host copies and point at those."""
        device_tensors = self.tensors(optimizer)
        # Optimizer state may have been created on the device by an update: re-list host copies.
        if len(device_tensors) != len(self.host):
            host = [torch.empty_like(t, device="cpu") for t in device_tensors]
            self.host = [t.pin_memory() for t in host] if pin else host
        for dst, src in zip(self.host, device_tensors):
            dst.copy_(src)
        self.point_to(self.host, optimizer)


def _state_items(optimizer: Optimizer | None, p: Tensor) -> list[tuple[str, Tensor]]:
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    # Scalar step counters stay on the host (torch keeps them there unless capturable).
    return [(k, v) for k, v in sorted(state.items()) if isinstance(v, Tensor) and v.dim() > 0]


class AsyncCopier:
    """Copies tensor lists to ``device`` in the background: a side CUDA stream, or one CPU thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._thread = None if self.cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="naspipe-prefetch")

    def start(self, sources: list[Tensor]) -> tuple[list[Tensor], Ready]:
        """Begin copying ``sources``; their new device copies, and what says when they are written."""
        # Normal tensors even under validation's inference mode: they may stay resident into training,
        # and the CPU copy thread (outside inference mode, which is per thread) writes into them.
        with torch.inference_mode(False):
            targets = [torch.empty_like(t, device=self.device) for t in sources]
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for dst, src in zip(targets, sources):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            return targets, event
        if self._thread is None:
            raise RuntimeError("the offloader was closed (NASPipeStrategy.teardown); it cannot copy any more")
        return targets, self._thread.submit(_copy_all, targets, sources)

    def wait(self, ready: Ready) -> None:
        """Make the compute stream (or this thread) wait for a copy."""
        if isinstance(ready, Future):
            ready.result()
        else:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def finish(self, ready: Ready) -> None:
        """Wait for a copy whose result will not be used (its targets are about to be dropped)."""
        if isinstance(ready, Future):
            ready.result()
        else:
            ready.synchronize()

    def close(self) -> None:
        """Stop the copy thread once pending copies are done."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _copy_all(targets: list[Tensor], sources: list[Tensor]) -> None:
    for dst, src in zip(targets, sources):
        dst.copy_(src)
