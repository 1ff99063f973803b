"""The links between data-parallel replicas, as the planner models them: what an update's exact reduction
costs, and what a ring all-reduce of the same bytes would.

The alpha-beta model: a message of ``n`` bytes over a link costs ``latency + n / bandwidth``; a link is
full duplex (each direction its own bandwidth). Replicas of a stage sit on neighbouring ranks (:class:`.Layout`),
``per_node`` ranks to a node: a hop between ranks on one node takes the intra-node link, any other the
inter-node one. Additions are not charged (both the chain and a ring add every byte once per replica, on
the device, faster than the links carry it).

* :func:`streamed_chain_ms`, the runtime's reduction (:mod:`~lightning_naspipe.pipeline.exactness.streamed`): ``P``
  pieces of ``S / P`` bytes down the chain, the sums back up, the return overlapping the way down: the first
  piece's way down and back (``2 (D - 1)`` hops) plus ``P - 1`` times the slowest hop's piece time.
* :func:`sequential_chain_ms`, the same if the two ways did not overlap at all (a replica's one port shared by
  both streams): a pessimistic bound, ``2 ((D - 1)`` hops ``+ (P - 1)`` slowest).
* :func:`whole_chain_ms`, the chain before pieces: ``2 (D - 1)`` whole-gradient hops.
* :func:`ring_ms`, NCCL's flat ring all-reduce: ``2 (D - 1)`` steps of ``S / D`` bytes, each as slow as the
  ring's slowest link (its closing hop included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_naspipe.pipeline.exactness.streamed import stream_pieces

__all__ = ["LINKS", "Link", "LinkModel", "ring_ms", "sequential_chain_ms", "streamed_chain_ms", "whole_chain_ms"]


@dataclass(frozen=True)
class Link:
    """One kind of link: ``gb_s`` GB/s per direction (1e9 bytes), ``latency_us`` per message."""

    gb_s: float
    latency_us: float

    def ms(self, nbytes: float) -> float:
        """Milliseconds for one message of ``nbytes``."""
        return self.latency_us / 1e3 + (nbytes / (self.gb_s * 1e6) if self.gb_s != float("inf") else 0.0)


@dataclass(frozen=True)
class LinkModel:
    """The links of a cluster: ``intra`` between ranks on one node, ``inter`` between nodes, ``per_node`` ranks
    (devices) per node."""

    intra: Link
    inter: Link
    per_node: int = 8

    def hops(self, replicas: int, first_rank: int = 0) -> list[Link]:
        """The link of each hop ``r -> r + 1`` of a chain of ``replicas`` ranks from ``first_rank``."""
        return [self.inter if (first_rank + r + 1) % self.per_node == 0 else self.intra for r in range(replicas - 1)]

    @classmethod
    def uniform(cls, latency_ms: float, ms_per_mb: float) -> LinkModel:
        """Every hop alike: ``latency_ms`` per message and ``ms_per_mb`` per MB (a :class:`.SpaceSpec`'s
        ``message_ms + message_cpu_ms`` and ``message_ms_per_mb``, measured on one host)."""
        link = Link(1.0 / ms_per_mb if ms_per_mb > 0 else float("inf"), latency_ms * 1e3)  # 1 MB/ms = 1 GB/s
        return cls(link, link, per_node=1 << 30)


#: Defaults, as effective point-to-point figures (not line rates) of common hardware; assumptions, not
#: measurements: NVLink 4 (H100 SXM, 8 per node), PCIe 4.0 x16 between GPUs of one node, 400 Gb/s
#: InfiniBand NDR and 100 Gb/s Ethernet (RoCE) between nodes, one NIC per GPU.
NVLINK = Link(150.0, 3.0)
PCIE = Link(20.0, 5.0)
IB_400 = Link(45.0, 6.0)
ETHERNET_100 = Link(11.0, 10.0)
LINKS: dict[str, LinkModel] = {
    "nvlink + ib400": LinkModel(NVLINK, IB_400),
    "nvlink + eth100": LinkModel(NVLINK, ETHERNET_100),
    "pcie + eth100": LinkModel(PCIE, ETHERNET_100),
}


def _pieces(nbytes: float, replicas: int, pieces: int | None) -> int:
    return max(1, pieces if pieces is not None else stream_pieces(int(nbytes), replicas))


def streamed_chain_ms(model: LinkModel, nbytes: float, replicas: int, first_rank: int = 0,
                      pieces: int | None = None) -> float:
    """Milliseconds of one update's streamed exact reduction of ``nbytes`` on ``replicas`` replicas.

    Args:
        model: the links.
        nbytes: the update's gradient bytes on the stage.
        replicas: the stage's replicas ``D`` (1: nothing to reduce).
        first_rank: replica 0's rank (where the node boundaries fall).
        pieces: ``P``; default: the runtime's :func:`.stream_pieces`.
    """
    if replicas < 2:
        return 0.0
    hops = model.hops(replicas, first_rank)
    count = _pieces(nbytes, replicas, pieces)
    piece = nbytes / count
    return 2 * sum(h.ms(piece) for h in hops) + (count - 1) * _slowest(hops, piece)


def sequential_chain_ms(model: LinkModel, nbytes: float, replicas: int, first_rank: int = 0,
                        pieces: int | None = None) -> float:
    """:func:`streamed_chain_ms` with the way back starting only once the way down is done (an upper bound)."""
    if replicas < 2:
        return 0.0
    hops = model.hops(replicas, first_rank)
    count = _pieces(nbytes, replicas, pieces)
    piece = nbytes / count
    return 2 * (sum(h.ms(piece) for h in hops) + (count - 1) * _slowest(hops, piece))


def whole_chain_ms(model: LinkModel, nbytes: float, replicas: int, first_rank: int = 0) -> float:
    """The chain before pieces: the whole gradient down every hop, then the sum relayed back."""
    return 2 * sum(h.ms(nbytes) for h in model.hops(replicas, first_rank))


def ring_ms(model: LinkModel, nbytes: float, replicas: int, first_rank: int = 0) -> float:
    """A flat ring all-reduce: ``2 (D - 1)`` steps of ``nbytes / D``, each waiting for the ring's slowest link."""
    if replicas < 2:
        return 0.0
    hops = model.hops(replicas, first_rank)
    closing = model.intra if first_rank // model.per_node == (first_rank + replicas - 1) // model.per_node \
        else model.inter
    return 2 * (replicas - 1) * _slowest([*hops, closing], nbytes / replicas)


def _slowest(hops: Sequence[Link], nbytes: float) -> float:
    return max(h.ms(nbytes) for h in hops)
