"""Context switch: a stage's supernet lives in host memory; the device holds what is in flight.

Each *resource* (a candidate or fixed block with state) has a host copy (its parameters,
buffers and optimizer state) and, while a subnet that uses it is in flight, a device copy; the
switching and copying are :mod:`.swapping`'s. This module is the policy over it: which resources
are resident, the device-byte budget and eviction, and the accounting. The schedule is known
ahead (subnets come from the counter-based sampler), so :class:`~.residency.WindowResidency`
prefetches resources before their subnet's first forward and releases them after its update
unless an upcoming subnet needs them again.

On a CPU-only machine the "device" copy is a separate pool of CPU tensors: the mechanism and
its accounting run (and are tested) exactly as on a GPU.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_naspipe.compat.torch import module_buffers
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.supernet import ResourceState
from lightning_naspipe.pipeline.offload.swapping import AsyncCopier, Ready, SwappedResource, nbytes


@dataclass
class OffloadStats:
    """Accounting of one stage's device-resident bytes and prefetch effectiveness."""

    device_bytes: int = 0
    peak_device_bytes: int = 0
    partition_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stall_seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass
class _Resident:
    tensors: list[Tensor]  # device copies, in the order of SwappedResource.tensors
    ready: Ready | None = None  # the copy still running
    users: int = 0
    nbytes: int = 0


class Offloader:
    """Keeps a stage's resources in host memory, and on the compute device while in use.

    Args:
        resources: the stage's resources: key -> its parameters and buffer slots.
        optimizer: the optimizer holding their parameters (its state moves with them).
        device: the compute device; on CPU a separate pool of tensors stands in for it.
        budget_bytes: optional cap on device-resident bytes; prefetching and caching stay
            under it, and a subnet that cannot fit alone is an error.
        reserve: bytes to budget per resource while resident (default: :func:`estimated_bytes`,
            which counts gradients and optimizer state before they exist).
    """

    def __init__(self, resources: Mapping[Any, ResourceState], optimizer: Optimizer | None,
                 device: torch.device, budget_bytes: int | None = None,
                 reserve: Mapping[Any, int] | None = None) -> None:
        self.device = device
        self.optimizer = optimizer
        self.budget = budget_bytes
        self.stats = OffloadStats()
        self._copier = AsyncCopier(device)
        self._pin = self._copier.cuda
        self._resources: dict[Hashable, SwappedResource] = {}
        self._resident: dict[Hashable, _Resident] = {}
        for key, state in resources.items():
            resource = self._resources[key] = SwappedResource.of(state)
            resource.move_to_host(optimizer, self._pin)
        self._reserve = dict(reserve) if reserve is not None else {
            key: estimated_bytes(state, optimizer) for key, state in resources.items()}
        # Bytes of each resource (parameters, buffers, optimizer state), wherever it lives.
        self._size = {key: self._bytes(key) for key in self._resources}
        self.stats.partition_bytes = sum(self._size.values())

    # -- the operations the executor and the residency policy use ---------------------------

    def prefetch(self, keys: Iterable[Hashable]) -> None:
        """Start copying ``keys`` to the device if the budget allows; never blocks."""
        for key in keys:
            if key in self._resident or key not in self._resources:
                continue
            if self.budget is not None and self._reserved() + self._reserve[key] > self.budget:
                self._evict_idle(self._reserve[key])
                if self._reserved() + self._reserve[key] > self.budget:
                    return
            self._start_copy(key)

    def acquire(self, keys: Iterable[Hashable]) -> None:
        """Make ``keys`` resident (waiting for their prefetch) and pin them until :meth:`release`."""
        keys = [k for k in keys if k in self._resources]
        needed = sum(self._reserve[k] for k in keys)
        if self.budget is not None and needed > self.budget:
            raise NASPipeConfigError(
                f"One subnet needs {needed} bytes of parameters and optimizer state on this stage, more than "
                f"offload_budget_bytes={self.budget}. Raise the budget or use more pipeline stages."
            )
        for key in keys:
            if key in self._resident:
                self.stats.prefetch_hits += 1
            else:
                self.stats.prefetch_misses += 1
                if self.budget is not None:
                    self._evict_idle(self._reserve[key])
                self._start_copy(key)
            self._wait(key)
            self._resident[key].users += 1

    def release(self, keys: Iterable[Hashable], keep: Iterable[Hashable] = ()) -> None:
        """Unpin ``keys``; evict those no longer used unless listed in ``keep`` (needed soon)."""
        keep = set(keep)
        for key in keys:
            resident = self._resident.get(key)
            if resident is None:
                continue
            resident.users -= 1
            if resident.users == 0 and key not in keep:
                self._evict(key)

    def close(self) -> None:
        """Stop the copy thread (CPU) once pending copies are done; the offloader is not used after this."""
        self._copier.close()

    def evict_all(self) -> None:
        """Put every idle resource back in host memory (e.g. at the end of a window)."""
        for key in [k for k, r in self._resident.items() if r.users == 0]:
            self._evict(key)

    def note_gradients(self, params: Sequence[Tensor]) -> None:
        """Count gradients (alive between a subnet's backward and its update) in the peak."""
        grads = nbytes(p.grad for p in params if p.grad is not None)
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes + grads)

    def note_update(self, keys: Iterable[Hashable]) -> None:
        """After an update: optimizer state may have been created on the device; count it."""
        for key in keys:
            resident = self._resident.get(key)
            if resident is not None and resident.ready is None:
                resident.nbytes = self._bytes(key)
                self.stats.partition_bytes += resident.nbytes - self._size[key]
                self._size[key] = resident.nbytes
        self._account()

    def rehost(self) -> None:
        """Move every non-resident resource's tensors (e.g. just loaded from a checkpoint) to the host."""
        for key, resource in self._resources.items():
            if key not in self._resident:
                resource.move_to_host(self.optimizer, self._pin)
                self._size[key] = self._bytes(key)
        self.stats.partition_bytes = sum(self._size.values())

    def is_resident(self, key: Hashable) -> bool:
        return key in self._resident and self._resident[key].ready is None

    # -- residency and budget ------------------------------------------------------------------

    def _bytes(self, key: Hashable) -> int:
        return nbytes(self._resources[key].tensors(self.optimizer))

    def _start_copy(self, key: Hashable) -> None:
        # The sources are the host copies, freshest after eviction.
        targets, ready = self._copier.start(self._resources[key].tensors(self.optimizer))
        self._resident[key] = _Resident(targets, ready, nbytes=nbytes(targets))
        self._account()

    def _wait(self, key: Hashable) -> None:
        resident = self._resident[key]
        if resident.ready is not None:
            start = time.perf_counter()
            self._copier.wait(resident.ready)
            self.stats.stall_seconds += time.perf_counter() - start
            resident.ready = None
            self._resources[key].point_to(resident.tensors, self.optimizer)

    def _evict(self, key: Hashable) -> None:
        resident = self._resident.pop(key)
        if resident.ready is not None:  # prefetched but never used: nothing changed on the device
            self._copier.finish(resident.ready)
        else:
            self._resources[key].write_back(self.optimizer, self._pin)
        self._account()

    def _account(self) -> None:
        self.stats.device_bytes = sum(r.nbytes for r in self._resident.values())
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes)

    def _evict_idle(self, room: int) -> None:
        for key in [k for k, r in self._resident.items() if r.users == 0]:
            if self.budget is None or self._reserved() + room <= self.budget:
                return
            self._evict(key)

    def _reserved(self) -> int:
        return sum(self._reserve[k] for k in self._resident)


def estimated_bytes(state: ResourceState, optimizer: Optimizer | None) -> int:
    """Device bytes a resource needs while in flight: parameters, their gradients and optimizer
    state, and buffers. Computed from shapes only, so every stage process gets the same number."""
    params = sum(p.numel() * p.element_size() for p in state.params)
    unique = {id(module_buffers(m)[n]): module_buffers(m)[n] for m, n in state.buffers}
    buffers = sum(b.numel() * b.element_size() for b in unique.values() if b is not None)
    return params * (2 + optimizer_state_factor(optimizer)) + buffers


def optimizer_state_factor(optimizer: Optimizer | None) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps per parameter (Adam: 2)."""
    if optimizer is None:
        return 0
    probe = torch.nn.Parameter(torch.zeros(3))
    probe.grad = torch.ones(3)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    try:
        twin = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        twin.step()
    except Exception:  # an optimizer we cannot probe: assume Adam-like state
        return 2
    return sum(1 for v in twin.state[probe].values() if isinstance(v, Tensor) and v.shape == probe.shape)
