"""Context switch: a stage's supernet lives in host memory; the device holds what is in flight.

Each *resource* (a candidate or fixed block with state) has a host copy — its parameters,
buffers and optimizer state — and, while a subnet that uses it is in flight, a device copy.
Parameters are switched by pointing ``param.data`` (and the optimizer's state entries) at one
copy or the other, so the model, the optimizer and checkpoints always see the current values
and copies are bitwise exact.

The schedule is known ahead (subnets come from the counter-based sampler), so resources are
prefetched before their subnet's first forward — on a side CUDA stream, or a background thread
on CPU — and evicted after its update unless an upcoming subnet needs them again.

On a CPU-only machine the "device" copy is a separate pool of CPU tensors: the mechanism and
its accounting run (and are tested) exactly as on a GPU, only the copies are plain memcpy.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.supernet import ResourceState


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
    tensors: list[Tensor]  # device copies, in the order of _Resource.host
    ready: Future[None] | torch.cuda.Event | None = None
    users: int = 0
    nbytes: int = 0


@dataclass
class _Resource:
    params: list[torch.nn.Parameter]
    buffers: list[list[tuple[torch.nn.Module, str]]]  # per buffer tensor, every slot holding it (tied)
    host: list[Tensor] = field(default_factory=list)


class Offloader:
    """Moves a stage's resources between host memory and the compute device.

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
        self._resources: dict[Hashable, _Resource] = {}
        self._resident: dict[Hashable, _Resident] = {}
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._copier = None if self._cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix="naspipe-prefetch")
        for key, state in resources.items():
            slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
            for m, n in state.buffers:
                slots.setdefault(id(m._buffers[n]), []).append((m, n))
            resource = _Resource(params=list(state.params), buffers=list(slots.values()))
            self._resources[key] = resource
            self._to_host(resource)
        self._reserve = dict(reserve) if reserve is not None else {
            key: estimated_bytes(state, optimizer) for key, state in resources.items()}
        # Bytes of each resource (parameters, buffers, optimizer state), wherever it lives.
        self._size = {key: self._bytes(key) for key in self._resources}
        self.stats.partition_bytes = sum(self._size.values())

    # -- the three operations the executor uses -------------------------------------------

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
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

    def evict_all(self) -> None:
        """Put every idle resource back in host memory (e.g. at the end of a window)."""
        for key in [k for k, r in self._resident.items() if r.users == 0]:
            self._evict(key)

    def note_gradients(self, params: Sequence[Tensor]) -> None:
        """Count gradients (alive between a subnet's backward and its update) in the peak."""
        grads = _nbytes(p.grad for p in params if p.grad is not None)
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes + grads)

    def is_resident(self, key: Hashable) -> bool:
        return key in self._resident and self._resident[key].ready is None

    # -- mechanics ---------------------------------------------------------------------------

    def _tensors(self, resource: _Resource) -> list[Tensor]:
        """Current tensors of a resource: parameters, buffers, then optimizer state, in a fixed order."""
        out: list[Tensor] = [p.data for p in resource.params]
        out += [group[0][0]._buffers[group[0][1]] for group in resource.buffers]  # type: ignore[misc]
        for p in resource.params:
            out += [v for _, v in self._state_items(p)]
        return out

    def _state_items(self, p: Tensor) -> list[tuple[str, Tensor]]:
        state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
        # Scalar step counters stay on the host (torch keeps them there unless capturable).
        return [(k, v) for k, v in sorted(state.items()) if isinstance(v, Tensor) and v.dim() > 0]

    def _point_to(self, resource: _Resource, tensors: list[Tensor]) -> None:
        it = iter(tensors)
        for p in resource.params:
            p.data = next(it)
        for group in resource.buffers:
            tensor = next(it)
            for m, n in group:  # tied buffers stay one tensor
                m._buffers[n] = tensor
        for p in resource.params:
            state = self.optimizer.state[p] if self.optimizer is not None and p in self.optimizer.state else {}
            for k, _ in self._state_items(p):
                state[k] = next(it)

    def _to_host(self, resource: _Resource) -> None:
        host = [t.detach().to("cpu") for t in self._tensors(resource)]
        if self._cuda:
            host = [t.pin_memory() for t in host]
        resource.host = host
        self._point_to(resource, host)

    def _bytes(self, key: Hashable) -> int:
        return _nbytes(self._tensors(self._resources[key]))

    def _start_copy(self, key: Hashable) -> None:
        resource = self._resources[key]
        sources = self._tensors(resource)  # the host copies, freshest after eviction
        # Normal tensors even under validation's inference mode: they may stay resident into training,
        # and the CPU copy thread (outside inference mode, which is per thread) writes into them.
        with torch.inference_mode(False):
            targets = [torch.empty_like(t, device=self.device) for t in sources]
        if self._cuda:
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for dst, src in zip(targets, sources):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            ready: Future[None] | torch.cuda.Event = event
        else:
            assert self._copier is not None
            ready = self._copier.submit(_copy_all, targets, sources)
        self._resident[key] = _Resident(targets, ready, nbytes=_nbytes(targets))
        self._account()

    def _wait(self, key: Hashable) -> None:
        resident = self._resident[key]
        if resident.ready is not None:
            start = time.perf_counter()
            if isinstance(resident.ready, Future):
                resident.ready.result()
            else:
                torch.cuda.current_stream(self.device).wait_event(resident.ready)
            self.stats.stall_seconds += time.perf_counter() - start
            resident.ready = None
            self._point_to(self._resources[key], resident.tensors)

    def _evict(self, key: Hashable) -> None:
        resident = self._resident.pop(key)
        resource = self._resources[key]
        if resident.ready is not None:  # prefetched but never used: nothing changed on the device
            self._wait_quietly(resident)
        else:
            device_tensors = self._tensors(resource)
            # Optimizer state may have been created on the device by this update: re-list host copies.
            if len(device_tensors) != len(resource.host):
                resource.host = [torch.empty_like(t, device="cpu") for t in device_tensors]
                if self._cuda:
                    resource.host = [t.pin_memory() for t in resource.host]
            for dst, src in zip(resource.host, device_tensors):
                dst.copy_(src)
            self._point_to(resource, resource.host)
        self._account()

    def _account(self) -> None:
        self.stats.device_bytes = sum(r.nbytes for r in self._resident.values())
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.stats.device_bytes)

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
                self._to_host(resource)
                self._size[key] = self._bytes(key)
        self.stats.partition_bytes = sum(self._size.values())

    def _wait_quietly(self, resident: _Resident) -> None:
        if isinstance(resident.ready, Future):
            resident.ready.result()
        elif resident.ready is not None:
            resident.ready.synchronize()

    def _evict_idle(self, room: int) -> None:
        for key in [k for k, r in self._resident.items() if r.users == 0]:
            if self.budget is None or self._reserved() + room <= self.budget:
                return
            self._evict(key)

    def _reserved(self) -> int:
        return sum(self._reserve[k] for k in self._resident)


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _copy_all(targets: list[Tensor], sources: list[Tensor]) -> None:
    for dst, src in zip(targets, sources):
        dst.copy_(src)


def estimated_bytes(state: ResourceState, optimizer: Optimizer | None) -> int:
    """Device bytes a resource needs while in flight: parameters, their gradients and optimizer
    state, and buffers. Computed from shapes only, so every stage process gets the same number."""
    params = sum(p.numel() * p.element_size() for p in state.params)
    unique = {id(m._buffers[n]): m._buffers[n] for m, n in state.buffers}
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


def memory_conflicts(resources: Sequence[frozenset[Hashable]], sizes: Mapping[Hashable, int],
                     budget: int) -> list[frozenset[Hashable]]:
    """Resources with extra conflicts so that what is in flight on a stage fits ``budget``.

    Subnet ``i`` may start only when the union of the resources of every not-yet-updated subnet
    ``j..i`` fits. Updates run in subnet order, so that means waiting for ``U(j-1)``: expressed as a
    resource shared by ``j-1`` and ``i``, the CSP rule enforces it. The oldest unfinished subnet
    always fits alone, so this cannot deadlock.

    Raises:
        NASPipeConfigError: a single subnet's resources on the stage exceed the budget.
    """
    out = [set(r) for r in resources]
    for i, own in enumerate(resources):
        alone = sum(sizes.get(k, 0) for k in own)
        if alone > budget:
            raise NASPipeConfigError(
                f"One subnet needs about {alone} bytes of parameters, gradients and optimizer state on a stage, "
                f"more than offload_budget_bytes={budget}. Raise the budget or use more pipeline stages."
            )
        union: set[Hashable] = set(own)
        j = i
        while j > 0 and sum(sizes.get(k, 0) for k in union | resources[j - 1]) <= budget:
            j -= 1
            union |= resources[j]
        if j > 0:
            token = ("memory", i)
            out[j - 1].add(token)
            out[i].add(token)
    return [frozenset(r) for r in out]


class WindowResidency:
    """The prefetch/evict policy for one window on one stage, driven by the schedule.

    Args:
        offloader: the stage's offloader.
        forward_order: window subnets in the order of their first forward on this stage.
        resources: per window subnet, its resource keys on this stage.
        lookahead: how many upcoming subnets to prefetch for.
    """

    def __init__(self, offloader: Offloader, forward_order: Sequence[int], resources: Sequence[frozenset[Hashable]],
                 lookahead: int = 2) -> None:
        self.offloader = offloader
        self.order = list(forward_order)
        self.resources = resources
        self.lookahead = lookahead
        self._started = 0
        self._in_flight: set[int] = set()
        if self.order:
            offloader.prefetch(self._upcoming_keys())

    def _upcoming_keys(self) -> list[Hashable]:
        upcoming = self.order[self._started: self._started + self.lookahead]
        return [key for k in upcoming for key in sorted(self.resources[k], key=repr)]

    def before_forward(self, subnet: int) -> None:
        """Subnet ``subnet`` starts its first forward on this stage."""
        self.offloader.acquire(self.resources[subnet])
        self._in_flight.add(subnet)
        self._started = self.order.index(subnet) + 1
        self.offloader.prefetch(self._upcoming_keys())

    def after_update(self, subnet: int) -> None:
        """Subnet ``subnet`` has been updated on this stage; its resources may go."""
        self._in_flight.discard(subnet)
        self.offloader.note_update(self.resources[subnet])
        keep = {key for k in self._in_flight for key in self.resources[k]} | set(self._upcoming_keys())
        self.offloader.release(self.resources[subnet], keep=keep)

    def finish(self) -> None:
        self.offloader.evict_all()
