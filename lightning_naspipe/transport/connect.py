"""The one choice of links between processes: shared memory when every process of the run is on this host
and the backend is not NCCL, else ``torch.distributed`` point-to-point calls (:class:`~.link.Link`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.transport.link import TRANSPORTS, Link, LostHandler, WaitHandler
from lightning_naspipe.transport.shm_links import SharedMemoryLinks, same_host
from lightning_naspipe.transport.torch_links import TorchLinks

__all__ = ["open_links"]


def open_links(position: int, ranks: Sequence[int], device: torch.device, timeout: timedelta, waited: WaitHandler,
               lost: LostHandler, *, links: str = "auto", spin_s: float = 0.0, group: Any = None) -> Link:
    """Open this process's links to its peers (collective: every process of the run calls it at once).

    Args:
        position: this process's index in ``ranks``.
        ranks: the global rank of each peer, by position.
        device: the compute device; NCCL moves messages there, every other backend through the host.
        timeout: how long a receive or a delivery may wait.
        waited: called with the time each receive blocked.
        lost: makes the error raised when a peer stops.
        links: ``"auto"``, ``"shared_memory"`` or ``"torch"`` (:data:`~.link.TRANSPORTS`).
        spin_s: with shared-memory links, how long a receive polls before it sleeps.
        group: the process group of exactly ``ranks`` when other groups connect at the same time.

    Raises:
        ValueError: ``links`` is not one of :data:`~.link.TRANSPORTS`.
        NASPipeConfigError: ``links="shared_memory"`` where the processes cannot share memory.
    """
    if links not in TRANSPORTS:
        raise ValueError(f"unknown links {links!r}; choose one of {TRANSPORTS}")
    nccl = dist.get_backend() == "nccl"
    shareable = not nccl and same_host(dist.get_world_size())  # collective: every process asks
    if links == "shared_memory" and not shareable:
        raise NASPipeConfigError(
            "NASPipeStrategy(transport='shared_memory') needs every stage process on one host (Linux, with "
            "/dev/shm) and a backend other than NCCL, which moves device tensors itself; use transport='auto'.")
    if links != "torch" and shareable:
        return SharedMemoryLinks.connect(position, ranks, timeout, waited, lost, spin_s, group)
    return TorchLinks(ranks, device if nccl else torch.device("cpu"), timeout, waited, lost)
