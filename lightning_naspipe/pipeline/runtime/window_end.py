"""A window's end: the last stage's losses summed in micro-batch order over the replicas, what ``compute_loss``
recorded, and the flags every process agrees on (preemption), shared with every stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lightning_naspipe.pipeline.exactness.replicas import ReplicaGroup, ordered_sum
from lightning_naspipe.pipeline.runtime.executor import Transport
from lightning_naspipe.pipeline.runtime.window import Window

__all__ = ["BoundarySignals", "agree_window_end", "sum_losses"]


class BoundarySignals(Protocol):
    """Flags the stages agree on at each window's end, with the losses (see :mod:`.preemption`)."""

    def flags(self) -> Sequence[int]:
        """This stage's flags; every stage gives as many."""
        ...

    def agreed(self, flags: Sequence[int]) -> None:
        """Each flag set (1) if any stage set it."""
        ...


def sum_losses(window: Window, size: int, share: range, replicas: ReplicaGroup | None) -> list[Any]:
    """On the last stage, fill ``window.losses`` of its first ``size`` subnets from every replica's micro-batch
    losses (this replica's are micro-batches ``share``), summed in micro-batch order; return the records of what
    their ``compute_loss`` logged, each subnet's in micro-batch order."""
    chunk_losses, records = window.chunk_losses, window.records
    if replicas is not None:
        parts = replicas.gather(([losses[share.start:share.stop] for losses in chunk_losses[:size]],
                                 [r for r in records if r[0] < window.first_index + size]))
        chunk_losses = [[loss for losses, _ in parts for loss in losses[k]] for k in range(size)]
        records = [r for _, kept in parts for r in kept]  # replica order is micro-batch order
    window.losses[:size] = [ordered_sum(losses) for losses in chunk_losses[:size]]
    for k in range(size):  # several subnets per step: each one's loss too, logged in the step's turn
        pieces, count = len(window.pieces[k]), len(window.steps[k])
        if count > 1 and window.losses[k] is not None:
            records += [(window.first_index + k, f"train_loss_subnet{j}",
                         ordered_sum(chunk_losses[k][j * pieces:(j + 1) * pieces]), (), {})
                        for j in range(count)]
    return records


def agree_window_end(own: Window, transport: Transport | None, replicas: ReplicaGroup | None,
                     signals: BoundarySignals | None) -> None:
    """Share the last stage's losses and records of ``own`` with every stage, and agree on the boundary flags:
    a flag set on any process (stage or replica) is set everywhere. Nothing to do alone."""
    if transport is None and replicas is None:
        return
    agreed = list(signals.flags()) if signals is not None else []
    if transport is not None:
        transport.end_window()
        losses, agreed, own.records = transport.share_window_end(own.losses, agreed, own.records)
        own.losses = list(losses)
    if replicas is not None:  # the columns agree too: a flag set in any of them
        replicas.flush()
        agreed = [max(flags) for flags in zip(*replicas.gather(agreed))]
    if signals is not None:
        signals.agreed(agreed)
