"""Messages among the data-parallel replicas of one stage (the :class:`~.pipeline.replicas.ReplicaGroup`
the engine uses for its exact gradient reduction).

The chain of partial sums travels point to point between neighbouring replicas, down the chain and
back (shared memory on one host, :class:`.SharedMemoryLinks`, else :class:`.TorchLinks`; sends never
wait); what is small and per window (the last stage's per-micro-batch losses, agreed flags) takes the
same way, gathered down the chain and relayed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_naspipe.transport.failures import FailureBoard, explained
from lightning_naspipe.transport.connect import open_links
from lightning_naspipe.transport.link import Link
from lightning_naspipe.transport.p2p import StageFailure

__all__ = ["ReplicaLinks", "layout_groups"]

# Groups are made once per process and layout: making them is collective and they are never freed.
_GROUPS: dict[tuple[int, int, bool, str, int], tuple[Any, Any]] = {}


def layout_groups(layout: Any, device: torch.device) -> tuple[Any, Any]:
    """This rank's process groups from torch's device mesh of ``layout`` (a :class:`.Layout`): its pipeline's
    (the ranks of every stage of its replica) and its stage's replicas' (collective on the first call)."""
    key = (layout.stages, layout.replicas, layout.replica_major, device.type, id(dist.group.WORLD))
    if key not in _GROUPS:
        from torch.distributed.device_mesh import init_device_mesh

        # The mesh numbers ranks row-major: its first dimension is the layout's slower-varying one.
        shape, names = ((layout.replicas, layout.stages), ("replica", "stage")) if layout.replica_major else (
            (layout.stages, layout.replicas), ("stage", "replica"))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        _GROUPS[key] = (mesh.get_group("stage"), mesh.get_group("replica"))
    return _GROUPS[key]


class ReplicaLinks:
    """This process's links to the other replicas of its stage.

    Args:
        replica: this process's replica.
        ranks: the global rank of each replica of this stage, in replica order.
        names: how errors name each global rank, indexed by it (e.g. ``"stage 1 replica 0 (rank 2)"``).
        group: the process group of exactly those ranks (to connect the links).
        device: the stage's compute device (message buffers live there with NCCL).
        timeout: how long a receive may wait before the peer is declared lost.
        failures: where processes post the error that stopped them (shared with the stage's transport).
        links: how messages travel, as :class:`.P2PTransport`'s ``links``.
        spin_s: with shared-memory links, how long a receive polls before it sleeps.

    Building it is collective: every process of the run builds its own at the same time.
    """

    def __init__(self, replica: int, ranks: Sequence[int], names: Sequence[str], group: Any, device: torch.device,
                 timeout: timedelta, failures: FailureBoard | None = None, links: str = "auto",
                 spin_s: float = 0.0) -> None:
        self._replica = replica
        self._failures = failures
        self.ranks = list(ranks)
        self.names = list(names)
        self._wait_s = 0.0
        self.links: Link = open_links(replica, self.ranks, device, timeout, self._waited, self._lost, links=links,
                                      spin_s=spin_s, group=group)

    @property
    def replica(self) -> int:
        return self._replica

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for another replica's sum (the rest of an update is busy time)."""
        return self._wait_s

    @property
    def failures(self) -> FailureBoard | None:
        return self._failures

    def send_next(self, value: Any) -> None:
        self.links.send(self._replica + 1, value)

    def recv_previous(self) -> Any:
        return self.links.recv(self._replica - 1)

    def send_previous(self, value: Any) -> None:
        self.links.send(self._replica - 1, value)

    def recv_next(self) -> Any:
        return self.links.recv(self._replica + 1)

    def from_last(self, value: Any) -> Any:
        if self._replica != len(self.ranks) - 1:  # relayed back down the chain
            value = self.links.recv(self._replica + 1)
        if self._replica > 0:
            self.links.send(self._replica - 1, value)
        return value

    def gather(self, value: Any) -> list[Any]:
        # Along the chain and back, on the links the sums take: on one host a few shared-memory messages
        # instead of a pickling collective over the process group (about 3 ms per call on the 2-core VM).
        parts = [value] if self._replica == 0 else [*self.links.recv(self._replica - 1), value]
        last = len(self.ranks) - 1
        if self._replica < last:
            self.links.send(self._replica + 1, parts)
        return list(self.from_last(parts if self._replica == last else None))

    def flush(self) -> None:
        """Wait until every message this replica sent has been delivered."""
        self.links.flush()

    def close(self) -> None:
        """Release the links (shared memory, FIFOs)."""
        self.links.close()

    def _waited(self, seconds: float, end: float) -> None:
        self._wait_s += seconds

    def _lost(self, replica: int | None, error: BaseException) -> StageFailure:
        if replica is None:
            return StageFailure(f"{self.names[self.ranks[self._replica]]} could not deliver a message to another "
                                f"replica of its stage: it failed or exited ({error}).{explained(self._failures)}")
        return StageFailure(f"Pipeline {self.names[self.ranks[replica]]} failed or exited: it stopped sending "
                            f"({error})." + explained(self._failures, " See that process's own error output for the "
                                                                      "cause."))
