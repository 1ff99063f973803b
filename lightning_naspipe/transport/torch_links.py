"""Messages between stage processes over ``torch.distributed`` point-to-point calls (gloo or NCCL).

The receiver must post a buffer of the exact size (NCCL requires it), so both ends of a link
remember the size of the link's last message and expect the same again; a value of another size
is preceded by a :data:`~.wire.RESIZE` message of the expected size (see :mod:`.wire`). Sends are
asynchronous and awaited by :meth:`TorchLinks.flush`; a receive is posted ahead on request
(:meth:`TorchLinks.post`), so its bytes land while the stage computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_naspipe.space.supernet import BlockValue
from lightning_naspipe.transport import wire as wire_format
from lightning_naspipe.transport.link import IdleWork, LostHandler, WaitHandler


class TorchLinks:
    """One stage's links to its neighbours, over ``torch.distributed``.

    Args:
        ranks: the global rank of each stage's process.
        device: where message buffers live (the stage's device with NCCL; the host with gloo).
        timeout: how long a receive or a delivery may wait.
        waited: called with the time each receive blocked.
        lost: makes the error raised when a neighbour stops.
    """

    def __init__(self, ranks: Sequence[int], device: torch.device, timeout: timedelta, waited: WaitHandler,
                 lost: LostHandler) -> None:
        self.ranks = list(ranks)
        self.device = device
        self.timeout = timeout
        self._waited = waited
        self._lost = lost
        self._pending: list[tuple[Any, Tensor]] = []
        # Per peer stage: the receive posted ahead for its next message, (work, buffer).
        self._posted: dict[int, tuple[Any, Tensor]] = {}
        # ("to" | "from", peer stage) -> bytes of the link's last message: the size expected next.
        self._link_size: dict[tuple[str, int], int] = {}
        #: Point-to-point messages sent (values plus size announcements).
        self.messages_sent = 0
        #: Work to do while a receive would wait (:data:`IdleWork`), set by the transport's owner.
        self.idle: IdleWork | None = None

    def send(self, stage: int, value: BlockValue) -> None:
        """Send ``value`` to ``stage`` without waiting for it to be received."""
        message = wire_format.pack(value, self.device)
        expected = self._link_size.get(("to", stage), wire_format.FIRST_SIZE)
        messages = [message]
        if message.numel() != expected:  # the receiver posts `expected` bytes: announce the new size
            messages.insert(0, wire_format.resize_message(expected, message.numel(), self.device))
        self._link_size[("to", stage)] = message.numel()
        for t in messages:
            # The tensor is kept alive until flush: the send reads it asynchronously.
            self._pending.append((dist.isend(t, self.ranks[stage]), t))
        self.messages_sent += len(messages)

    def post(self, stage: int) -> None:
        """Post the receive of the next message from ``stage`` (no-op if one is posted)."""
        if stage not in self._posted:
            self._posted[stage] = self._irecv(stage)

    def recv(self, stage: int) -> BlockValue:
        """The next value from ``stage`` (its tensors on :attr:`device`)."""
        posted = self._posted.pop(stage, None)
        work, message = posted if posted is not None else self._irecv(stage)
        self._await(work, stage)
        announced = wire_format.resized(message)
        if announced is not None:
            work, message = self._irecv(stage, announced)
            self._await(work, stage)
            self._link_size[("from", stage)] = announced
        return wire_format.unpack(message)

    def flush(self) -> None:
        """Wait until every message sent so far has been delivered."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                raise self._lost(None, error) from error

    def close(self) -> None:
        """Nothing to release: the process group outlives the links."""

    def _irecv(self, stage: int, size: int | None = None) -> tuple[Any, Tensor]:
        if size is None:
            size = self._link_size.get(("from", stage), wire_format.FIRST_SIZE)
        message = torch.empty(size, dtype=torch.uint8, device=self.device)
        try:
            return dist.irecv(message, self.ranks[stage]), message
        except RuntimeError as error:
            raise self._lost(stage, error) from error

    def _await(self, work: Any, stage: int) -> None:
        start = time.perf_counter()
        worked = 0.0
        while self.idle is not None and not work.is_completed():
            began = time.perf_counter()
            if not self.idle():
                break
            worked += time.perf_counter() - began
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            raise self._lost(stage, error) from error
        end = time.perf_counter()
        self._waited(end - start - worked, end)
