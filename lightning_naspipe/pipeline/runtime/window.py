"""A window: the training steps of one Lightning batch, their architectures and micro-batches, and what the
last stage computes for them (losses, what ``compute_loss`` logged)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_naspipe.pipeline.runtime.microbatch import Batch
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import BlockValue

__all__ = ["Window"]


@dataclass
class Window:
    """The subnets of one Lightning batch and their micro-batches.

    Attributes:
        first_index: global index (training step) of the window's first subnet.
        architectures: one architecture per subnet.
        pieces: per subnet, its ``(micro-batch, weight)`` pairs (all of them, also where a replica
            trains only its share).
        losses: per subnet, its loss (the weighted sum of its micro-batch losses, in micro-batch
            order); filled on the last stage only, from :attr:`chunk_losses`, when the window has run.
        chunk_losses: per subnet, each micro-batch's weighted loss where this process computed it.
        steps: per training step (a "subnet" above), the architectures it trains on its batch, in the order
            their gradients accumulate (``[architecture]`` by default): micro-batch ``m`` of step ``k`` is
            piece ``m % len(pieces[k])`` run by ``steps[k][m // len(pieces[k])]``.
        records: what ``compute_loss`` recorded on the last stage (see :func:`loss_context`), in the
            order it ran; after :meth:`.Engine.run_window`, the last stage's on every stage.
    """

    first_index: int
    architectures: list[Architecture]
    pieces: list[list[tuple[Batch, float]]]
    losses: list[Tensor | None] = field(default_factory=list)
    records: list[Any] = field(default_factory=list)
    chunk_losses: list[list[Tensor | None]] = field(default_factory=list)
    steps: list[list[Architecture]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.losses = [None] * len(self.architectures)
        if not self.steps:
            self.steps = [[architecture] for architecture in self.architectures]
        self.chunk_losses = [[None] * (len(pieces) * len(step)) for pieces, step in zip(self.pieces, self.steps)]

    def micro_batch(self, k: int, m: int) -> tuple[Architecture, BlockValue, float, int, int]:
        """Micro-batch ``m`` of step ``k``: its architecture, batch piece and weight, and which subnet of the
        step and which piece of the batch it is."""
        pieces = len(self.pieces[k])
        j, c = divmod(m, pieces)
        piece, weight = self.pieces[k][c]
        return self.steps[k][j], piece, weight, j, c

    def split(self, size: int) -> tuple[Window, Window | None]:
        """The first ``size`` subnets (with this window's losses and records) and the rest (``None`` when
        there is none): a window run with the next one's forwards ahead trains only its own part."""
        own = Window(self.first_index, self.architectures[:size], self.pieces[:size], steps=self.steps[:size])
        own.losses, own.records = self.losses[:size], self.records
        if size == len(self.architectures):
            return own, None
        rest = Window(self.first_index + size, self.architectures[size:], self.pieces[size:], steps=self.steps[size:])
        return own, rest
