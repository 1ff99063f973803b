"""In-place distillation on the last stage: each training step's first subnet's detached output per batch piece,
the teacher of the step's later subnets (``compute_loss(output, batch, teacher=...)``), and its relay along a
stage's data-parallel replicas.

Replicas train contiguous shares of a step's micro-batches in accumulation order, subnet by subnet
(:meth:`.Engine.chunk_share_of`), so the first replicas compute the teacher pieces and the others need them. On the
last stage every step waits for the update of the step before (:func:`.plan_window`'s ``chained_last``), so a step's
forwards there run with no update between them, and no other message travels between the replicas meanwhile. In
that span each replica sends the next one every teacher piece it computes, and a later replica, at its first forward
of the step, receives (and passes on) every piece the replicas before it computed: in piece order at both ends of
every link. Cost per step: at most ``pieces`` messages of the last stage's output per link.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_naspipe.pipeline.exactness.replicas import ReplicaGroup
from lightning_naspipe.space.supernet import BlockValue
from lightning_naspipe.space.boundary import map_tensors

__all__ = ["Teachers", "wants_teacher"]


def wants_teacher(module: Any) -> bool:
    """Whether ``module.compute_loss`` takes a ``teacher`` (in-place distillation)."""
    return "teacher" in inspect.signature(module.compute_loss).parameters


class Teachers:
    """The teachers this last-stage process holds, by ``(step index, batch piece)``, kept from a step's first
    forward to its update (forwards may run a window ahead, so the engine keeps one for the whole run).

    Args:
        group: the replicas of the last stage; ``None`` with one replica.
    """

    def __init__(self, group: ReplicaGroup | None = None) -> None:
        self.group = group if group is not None and group.replicas > 1 else None
        self._kept: dict[tuple[int, int], BlockValue] = {}

    def relay(self, index: int, chunk: int, pieces: int, offset: int) -> None:
        """At a replica's action chunk ``chunk`` of step ``index`` (its micro-batches start at ``offset``): at its
        first, receive every teacher piece the replicas before it computed (those below ``offset``), each passed on."""
        group = self.group
        if group is None or chunk or not offset:
            return
        for piece in range(min(pieces, offset)):
            value = group.recv_previous()
            self._kept[(index, piece)] = value
            if group.replica + 1 < group.replicas:
                group.send_next(value)

    def keep(self, index: int, piece: int, output: BlockValue) -> None:
        """The step's first subnet's ``output`` of batch piece ``piece``: keep it detached, and send it on."""
        value = map_tensors(lambda t: t.detach(), output)
        self._kept[(index, piece)] = value
        if self.group is not None and self.group.replica + 1 < self.group.replicas:
            self.group.send_next(value)

    def teacher(self, index: int, piece: int) -> BlockValue | None:
        """The teacher of step ``index``'s later subnets on batch piece ``piece``."""
        return self._kept.get((index, piece))

    def drop_from(self, index: int, last: int | None = None) -> None:
        """Forget the teachers of steps ``index`` and later (up to ``last``, inclusive, where given)."""
        for key in [key for key in self._kept if key[0] >= index and (last is None or key[0] <= last)]:
            del self._kept[key]
