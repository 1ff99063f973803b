"""Moving activations and gradients between neighbouring stage processes.

Each link (stage ``s`` → ``s+1`` for activations, ``s+1`` → ``s`` for gradients) is FIFO, as
point-to-point messages are with gloo and NCCL. The receiver knows the sender's order from the
window's schedule (every process computes the same schedule), so it receives in that order and
buffers messages it does not need yet; the schedule's replay check guarantees this cannot hang.
Sends are asynchronous and awaited at the end of the window, so a stage computes while its
outputs are in flight.

A message is a tensor or a tuple of tensors of any shape and dtype: a small header (count,
dtypes, shapes) goes first so the receiver can allocate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_naspipe.distributed import broadcast_object
from lightning_naspipe.schedule import Schedule

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
# Header slots sent in one message: [length, is_tuple, count, (dtype, ndim, *shape) per tensor].
HEADER_SLOTS = 24


class StageFailure(RuntimeError):
    """A neighbouring stage failed or its process died."""


class P2PTransport:
    """Point-to-point transport for one stage, over ``torch.distributed``.

    Args:
        stage: this process's stage.
        ranks: the global rank of each stage's process.
        device: where received tensors are placed (the stage's compute device).
        timeout: how long a receive may wait before the peer is declared lost.
    """

    def __init__(self, stage: int, ranks: Sequence[int], device: torch.device, timeout: timedelta) -> None:
        self.stage = stage
        self.ranks = list(ranks)
        self.device = device
        self.timeout = timeout
        self._pending: list[tuple[Any, list[Tensor]]] = []
        #: Receives block here; set by the engine to attribute that time (``StageTelemetry``).
        self.telemetry: Any = None
        # Per incoming link: the (subnet, chunk) sequence still to arrive, and early arrivals.
        self._expected: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": []}
        self._buffer: dict[str, dict[tuple[int, int], Any]] = {"forward": {}, "backward": {}}

    def begin_window(self, schedule: Schedule) -> None:
        """Learn the order in which the neighbours will send during this window."""
        if self.stage > 0:
            self._expected["forward"] = list(schedule.sends(self.stage - 1, "forward"))[::-1]
        if self.stage < len(self.ranks) - 1:
            self._expected["backward"] = list(schedule.sends(self.stage + 1, "backward"))[::-1]

    def end_window(self) -> None:
        """Wait until every message this stage sent has been delivered."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work, "deliver a message to a neighbouring stage")

    def send_activation(self, subnet: int, chunk: int, value: Any) -> None:
        self._send(self.stage + 1, value)

    def recv_activation(self, subnet: int, chunk: int) -> Any:
        return self._recv_for("forward", self.stage - 1, (subnet, chunk), requires_grad=True)

    def send_gradient(self, subnet: int, chunk: int, value: Any) -> None:
        self._send(self.stage - 1, value)

    def recv_gradient(self, subnet: int, chunk: int) -> Any:
        return self._recv_for("backward", self.stage + 1, (subnet, chunk), requires_grad=False)

    def share(self, value: Any) -> Any:
        """The last stage's ``value`` (e.g. an evaluation output) on every stage."""
        last = len(self.ranks) - 1
        return broadcast_object(value if self.stage == last else None, self.ranks[last], self.device)

    def share_losses(self, losses: Sequence[Tensor | None]) -> list[Tensor]:
        """The last stage's scalar losses on every stage, bit for bit.

        One tensor broadcast instead of pickling: ``[dtype code, loss0, loss1, ...]`` in float64,
        which holds float32, float16 and bfloat16 values exactly.
        """
        last = len(self.ranks) - 1
        packed = torch.zeros(len(losses) + 1, dtype=torch.float64, device=self._wire_device())
        if self.stage == last:
            values = [loss for loss in losses if loss is not None]
            packed[0] = _CODE[values[0].dtype] if values else 0
            packed[1:] = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]).to(packed.device)
        dist.broadcast(packed, src=self.ranks[last])
        dtype = _DTYPES[int(packed[0].item())]
        return [v.to(dtype).to(self.device) for v in packed[1:]]

    def send_value(self, stage: int, value: Any) -> None:
        """Send outside a window's schedule (evaluation); the peer must call :meth:`recv_value`."""
        self._send(stage, value)

    def recv_value(self, stage: int) -> Any:
        return self._recv(stage, requires_grad=False)

    # -- the wire format ------------------------------------------------------------------

    def _send(self, stage: int, value: Any) -> None:
        tensors, is_tuple = _flatten(value)
        header = [int(is_tuple), len(tensors)]
        for t in tensors:
            header += [_CODE[t.dtype], t.dim(), *t.shape]
        header = [len(header) + 1, *header]
        wire = self._wire_device()
        # One fixed-size header message covers common values; a longer header sends its tail next.
        padded = header + [0] * (HEADER_SLOTS - len(header))
        messages = [torch.tensor(padded[:HEADER_SLOTS], dtype=torch.int64, device=wire)]
        if len(header) > HEADER_SLOTS:
            messages.append(torch.tensor(header[HEADER_SLOTS:], dtype=torch.int64, device=wire))
        messages += [t.detach().to(self.device).contiguous() for t in tensors]
        dst = self.ranks[stage]
        for t in messages:
            # The tensor is kept alive until end_window: the send reads it asynchronously.
            self._pending.append((dist.isend(t, dst), [t]))

    def _recv_for(self, link: str, stage: int, key: tuple[int, int], requires_grad: bool) -> Any:
        buffer = self._buffer[link]
        while key not in buffer:
            expected = self._expected[link]
            if not expected:
                raise RuntimeError(f"stage {self.stage} waits for {link} message {key} that the schedule never sends")
            buffer[expected.pop()] = self._recv(stage, requires_grad)
        return buffer.pop(key)

    def _recv(self, stage: int, requires_grad: bool) -> Any:
        src = self.ranks[stage]
        head = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self._wire_device())
        self._recv_into(head, src, stage)
        header = head.tolist()
        if header[0] > HEADER_SLOTS:
            tail = torch.empty(header[0] - HEADER_SLOTS, dtype=torch.int64, device=self._wire_device())
            self._recv_into(tail, src, stage)
            header += tail.tolist()
        is_tuple, count, pos = bool(header[1]), header[2], 3
        tensors = []
        for _ in range(count):
            dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
            shape = header[pos + 2: pos + 2 + ndim]
            pos += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv_into(t, src, stage)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            tensors.append(t)
        return tuple(tensors) if is_tuple else tensors[0]

    def _recv_into(self, tensor: Tensor, src: int, stage: int) -> None:
        try:
            work = dist.irecv(tensor, src)
        except RuntimeError as error:
            raise _lost(stage, src, error) from error
        start = time.perf_counter()
        self._wait(work, f"receive from stage {stage} (rank {src})", stage=stage, rank=src)
        if self.telemetry is not None:
            end = time.perf_counter()
            self.telemetry.waited(end - start, end)

    def _wait(self, work: Any, what: str, stage: int | None = None, rank: int | None = None) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            if stage is None:
                raise StageFailure(f"stage {self.stage} could not {what}: a neighbouring stage failed or exited "
                                   f"({error}).") from error
            raise _lost(stage, rank, error) from error

    def _wire_device(self) -> torch.device:
        # NCCL moves only device tensors; gloo only host ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _flatten(value: Any) -> tuple[list[Tensor], bool]:
    if isinstance(value, Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return list(value), True
    raise TypeError(
        f"A block on a stage boundary returned {type(value).__name__}; blocks must pass a tensor or a tuple of "
        "tensors to the next stage."
    )


def _lost(stage: int, rank: int | None, error: BaseException) -> StageFailure:
    return StageFailure(
        f"Pipeline stage {stage} (rank {rank}) failed or exited: it stopped sending ({error}). "
        "See that stage's own error output for the cause."
    )
