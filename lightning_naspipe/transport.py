"""Moving activations and gradients between neighbouring stage processes.

Each link (stage ``s`` → ``s+1`` for activations, ``s+1`` → ``s`` for gradients) is FIFO, as
point-to-point messages are with gloo and NCCL. The receiver knows the sender's order from the
window's schedule (every process computes the same schedule), so it receives in that order and
buffers messages it does not need yet; the schedule's replay check guarantees this cannot hang.
Sends are asynchronous and awaited at the end of the window, so a stage computes while its
outputs are in flight. Receives are posted ahead: as soon as a link's previous message has arrived,
the next one the schedule names is posted, so the bytes land while the stage computes and the
hand-over is off the critical path.

A value is anything a block may pass on (see :mod:`.boundary`), sent as one message that
carries its own header (see :mod:`.wire`); the receiver gets what :func:`.boundary.cut` would
give it in process. Gradients travel as a tuple aligned with the activation's tensors that
require grad, ``None`` where none flowed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_naspipe import wire as wire_format
from lightning_naspipe.boundary import map_tensors
from lightning_naspipe.distributed import broadcast_object
from lightning_naspipe.failures import FailureBoard, default_store
from lightning_naspipe.schedule import Schedule
from lightning_naspipe.stage_table import describe


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
        # Per incoming link: the receive posted ahead for its next expected message, (work, buffer).
        self._posted: dict[str, tuple[Any, Tensor] | None] = {"forward": None, "backward": None}
        # ("to" | "from", peer stage) -> bytes of the link's last message: the size expected next.
        self._link_size: dict[tuple[str, int], int] = {}
        #: Point-to-point messages this stage has sent (values plus size announcements).
        self.messages_sent = 0
        #: Seconds spent waiting for messages (the rest of a window's run is busy time).
        self.wait_s = 0.0
        #: What the first activation this stage sent looked like (see :func:`.stage_table.describe`).
        self.first_activation: str | None = None
        stage_of_rank = {rank: s for s, rank in enumerate(self.ranks)}
        #: Where a failing stage posts its error, so that the others (rank 0 above all) can name it.
        self.failures = FailureBoard(default_store(), self.ranks[stage],
                                     [stage_of_rank.get(r, -1) for r in range(max(self.ranks) + 1)])

    def begin_window(self, schedule: Schedule) -> None:
        """Learn the order in which the neighbours will send during this window."""
        if self.stage > 0:
            self._expected["forward"] = list(schedule.sends(self.stage - 1, "forward"))[::-1]
            self._post("forward", self.stage - 1)
        if self.stage < len(self.ranks) - 1:
            self._expected["backward"] = list(schedule.sends(self.stage + 1, "backward"))[::-1]
            self._post("backward", self.stage + 1)

    def end_window(self) -> None:
        """Wait until every message this stage sent has been delivered."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work, "deliver a message to a neighbouring stage")

    def send_activation(self, subnet: int, chunk: int, value: Any) -> None:
        if self.first_activation is None:
            self.first_activation = describe(value)
        self._send(self.stage + 1, value)

    def recv_activation(self, subnet: int, chunk: int) -> Any:
        return self._recv_for("forward", self.stage - 1, (subnet, chunk))

    def send_gradient(self, subnet: int, chunk: int, value: Any) -> None:
        self._send(self.stage - 1, value)

    def recv_gradient(self, subnet: int, chunk: int) -> Any:
        return self._recv_for("backward", self.stage + 1, (subnet, chunk))

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
            packed[0] = wire_format.CODE[values[0].dtype] if values else 0
            packed[1:] = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]).to(packed.device)
        dist.broadcast(packed, src=self.ranks[last])
        dtype = wire_format.DTYPES[int(packed[0].item())]
        return [v.to(dtype).to(self.device) for v in packed[1:]]

    def send_value(self, stage: int, value: Any) -> None:
        """Send outside a window's schedule (evaluation); the peer must call :meth:`recv_value`."""
        self._send(stage, value)

    def recv_value(self, stage: int) -> Any:
        return self._recv(stage)

    # -- messages -------------------------------------------------------------------------

    def _send(self, stage: int, value: Any) -> None:
        wire = self._wire_device()
        message = wire_format.pack(value, wire)
        expected = self._link_size.get(("to", stage), wire_format.FIRST_SIZE)
        messages = [message]
        if message.numel() != expected:  # the receiver posts `expected` bytes: announce the new size
            messages.insert(0, wire_format.resize_message(expected, message.numel(), wire))
        self._link_size[("to", stage)] = message.numel()
        dst = self.ranks[stage]
        for t in messages:
            # The tensor is kept alive until end_window: the send reads it asynchronously.
            self._pending.append((dist.isend(t, dst), [t]))
        self.messages_sent += len(messages)

    def _recv_for(self, link: str, stage: int, key: tuple[int, int]) -> Any:
        buffer = self._buffer[link]
        while key not in buffer:
            expected = self._expected[link]
            if not expected:
                raise RuntimeError(f"stage {self.stage} waits for {link} message {key} that the schedule never sends")
            posted, self._posted[link] = self._posted[link], None
            buffer[expected.pop()] = self._recv(stage, posted)
            self._post(link, stage)
        return buffer.pop(key)

    def _post(self, link: str, stage: int) -> None:
        """Post the receive of ``link``'s next expected message, if the window has one more."""
        if self._expected[link] and self._posted[link] is None:
            self._posted[link] = self._irecv(stage)

    def _irecv(self, stage: int, size: int | None = None) -> tuple[Any, Tensor]:
        """Post a receive from ``stage`` of ``size`` bytes (default: the size that link expects next)."""
        if size is None:
            size = self._link_size.get(("from", stage), wire_format.FIRST_SIZE)
        message = torch.empty(size, dtype=torch.uint8, device=self._wire_device())
        try:
            return dist.irecv(message, self.ranks[stage]), message
        except RuntimeError as error:
            raise self._lost(stage, self.ranks[stage], error) from error

    def _recv(self, stage: int, posted: tuple[Any, Tensor] | None = None) -> Any:
        src = self.ranks[stage]
        work, message = posted or self._irecv(stage)
        self._await(work, src, stage)
        announced = wire_format.resized(message)
        if announced is not None:
            work, message = self._irecv(stage, announced)
            self._await(work, src, stage)
            self._link_size[("from", stage)] = announced
        value = wire_format.unpack(message)
        if message.device == self.device:
            return value
        return map_tensors(lambda t: t.detach().to(self.device).requires_grad_(t.requires_grad), value)

    def _await(self, work: Any, src: int, stage: int) -> None:
        start = time.perf_counter()
        self._wait(work, f"receive from stage {stage} (rank {src})", stage=stage, rank=src)
        end = time.perf_counter()
        self.wait_s += end - start
        if self.telemetry is not None:
            self.telemetry.waited(end - start, end)

    def _wait(self, work: Any, what: str, stage: int | None = None, rank: int | None = None) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            if stage is None:
                raise StageFailure(f"stage {self.stage} could not {what}: a neighbouring stage failed or exited "
                                   f"({error}).{self._cause()}") from error
            raise self._lost(stage, rank, error) from error

    def _lost(self, stage: int, rank: int | None, error: BaseException) -> StageFailure:
        return StageFailure(f"Pipeline stage {stage} (rank {rank}) failed or exited: it stopped sending ({error})."
                            + (self._cause() or " See that stage's own error output for the cause."))

    def _cause(self) -> str:
        causes = self.failures.causes()
        return "".join(f"\n{cause}" for cause in causes)

    def _wire_device(self) -> torch.device:
        # NCCL moves only device tensors; gloo only host ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")
