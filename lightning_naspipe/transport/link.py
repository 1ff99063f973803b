"""The point-to-point link contract: what a stage's (or a replica's) links to its neighbours do, whatever carries
the bytes.

Two implementations keep it: :class:`~.shm_links.SharedMemoryLinks` (processes on one host) and
:class:`~.torch_links.TorchLinks` (``torch.distributed``'s ``isend``/``irecv``: NCCL, or several hosts);
:func:`~.connect.open_links` chooses between them. A new transport implements :class:`Link` and is added to
that one choice; the pipeline's transport (:class:`~.p2p.P2PTransport`) and the replicas' chained sums
(:class:`~.replica_links.ReplicaLinks`) use only this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from lightning_naspipe.space.supernet import BlockValue

__all__ = ["TRANSPORTS", "IdleWork", "Link", "LinkKind", "LostHandler", "WaitHandler"]

#: ``links`` a transport accepts: ``"auto"`` (shared memory where it can, else torch), or one of the two.
LinkKind = Literal["auto", "shared_memory", "torch"]
TRANSPORTS: tuple[LinkKind, ...] = ("auto", "shared_memory", "torch")
#: ``lost(peer, error)``: the error to raise when neighbour ``peer`` stopped (``None``: a send failed).
LostHandler = Callable[[int | None, BaseException], BaseException]
#: ``waited(seconds, end)``: a receive blocked for ``seconds`` until ``end`` (``perf_counter``).
WaitHandler = Callable[[float, float], None]
#: ``idle()``: work a receive may do while its message is not there yet; returns ``False`` when it did
#: none (then the receive waits). Its time is not counted as waiting.
IdleWork = Callable[[], bool]


class Link(Protocol):
    """One process's links to its peers (stages of a pipeline, or replicas of a stage), indexed by position.

    Messages between two peers arrive in the order they were sent; a value keeps its structure, dtypes,
    layouts and ``requires_grad`` flags (:mod:`.wire`).
    """

    #: Work to do while a receive would wait, set by the links' owner.
    idle: IdleWork | None
    #: Messages sent so far (with ``torch`` links, size announcements too).
    messages_sent: int

    def send(self, peer: int, value: BlockValue) -> None:
        """Send ``value`` to ``peer``; returns before it is delivered (see :meth:`flush`)."""

    def post(self, peer: int) -> None:
        """Get ready for ``peer``'s next message, so that its bytes can land while this process computes."""

    def recv(self, peer: int) -> BlockValue:
        """``peer``'s next message, waiting for it (doing :attr:`idle` work meanwhile)."""

    def flush(self) -> None:
        """Wait until every message sent so far has been delivered."""

    def close(self) -> None:
        """Release the links' resources (rings, FIFOs, posted receives)."""
