"""Moving activations and gradients between neighbouring stage processes.

Each link (stage ``s`` → ``s+1`` for activations, ``s+1`` → ``s`` for gradients) is FIFO. The
receiver knows the sender's order from the window's schedule (every process computes the same
schedule), so it receives in that order and buffers messages it does not need yet; the schedule's
replay check guarantees this cannot hang. Sends never wait for the receiver, so a stage computes
while its outputs are in flight. The messages themselves travel over shared memory when every stage
runs on one host without NCCL (:mod:`.shm_links`), else over ``torch.distributed`` point-to-point
calls (:mod:`.torch_links`, with receives posted ahead so the bytes land while the stage computes).
The same links carry the gradient-norm exchange of clipping, each window's losses and agreed flags
(:meth:`P2PTransport.share_window_end`) and evaluation values.

A value is anything a block may pass on (see :mod:`.boundary`), sent as one message that
carries its own header (see :mod:`.wire`); the receiver gets what :func:`.boundary.cut` would
give it in process. Gradients travel as a tuple aligned with the activation's tensors that
require grad, ``None`` where none flowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_naspipe.transport import wire as wire_format
from lightning_naspipe.space.boundary import Gradients, map_tensors
from lightning_naspipe.transport.failures import FailureBoard, default_store, explained
from lightning_naspipe.schedule.actions import NORMS, Schedule
from lightning_naspipe.transport.connect import open_links
from lightning_naspipe.transport.link import IdleWork, Link, LinkKind
from lightning_naspipe.space.supernet import BlockValue, describe

#: How messages travel: ``"auto"`` (shared memory where possible), ``"shared_memory"`` or ``"torch"``.


#: Where the previous stage's window-end flags wait in the activation link's buffer (no subnet is < 0).
_FLAGS = (-1, 0)


class StageFailure(RuntimeError):
    """A neighbouring stage failed or its process died."""


class P2PTransport:
    """Point-to-point transport for one stage (building it is collective: every stage process does).

    Args:
        stage: this process's stage.
        ranks: the global rank of each stage's process.
        device: where received tensors are placed (the stage's compute device).
        timeout: how long a receive may wait before the peer is declared lost.
        links: how messages travel (:data:`TRANSPORTS`): ``"auto"`` uses shared memory when every stage
            process runs on this host and the backend is not NCCL, else ``torch.distributed``.
        spin_s: with shared-memory links, how long a receive polls before it sleeps (see
            :class:`.SharedMemoryLinks`); 0 unless this process has cores of its own.
        group: the process group of exactly ``ranks`` when there are other pipelines (data-parallel
            replicas of this one); ``None``: every process is a stage of this one.
        names: how errors name each global rank, indexed by it (default ``"stage s (rank r)"``).
    """

    def __init__(self, stage: int, ranks: Sequence[int], device: torch.device, timeout: timedelta,
                 links: LinkKind = "auto", spin_s: float = 0.0,
                 group: Any = None, names: Sequence[str] | None = None) -> None:
        self.stage = stage
        self.ranks = list(ranks)
        self.group = group
        stage_of_rank = {rank: s for s, rank in enumerate(self.ranks)}
        self.names = list(names) if names is not None else [
            f"stage {stage_of_rank[r]} (rank {r})" if r in stage_of_rank else f"rank {r}"
            for r in range(max(self.ranks) + 1)]
        self.device = device
        self.timeout = timeout
        #: Receives block here; set by the engine to attribute that time (``StageTelemetry``).
        self.telemetry: Any = None
        # Per incoming link: the (subnet, chunk) sequence still to arrive, and early arrivals.
        self._expected: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": []}
        self._buffer: dict[str, dict[tuple[int, int], Any]] = {"forward": {}, "backward": {}}
        # The previous stage's window-end flags (see share_window_end) are yet to be taken off the link.
        self._flags_owed = False
        #: Seconds spent waiting for messages (the rest of a window's run is busy time).
        self.wait_s = 0.0
        #: What the first activation this stage sent looked like (see :func:`.boundary.describe`).
        self.first_activation: str | None = None
        #: Where a failing stage posts its error, so that the others (rank 0 above all) can name it.
        self.failures = FailureBoard(default_store(), self.ranks[stage], self.names)
        nccl = dist.get_backend() == "nccl"
        # Where messages arrive: NCCL moves only device tensors, gloo only host ones.
        self._wire = device if nccl else torch.device("cpu")
        self.links: Link = open_links(stage, self.ranks, device, timeout, self._waited, self._lost, links=links,
                                      spin_s=spin_s, group=group)

    @property
    def idle(self) -> IdleWork | None:
        """Work a receive may do while its message is not there yet (:data:`.torch_links.IdleWork`),
        e.g. reading the next batches (:meth:`.WindowLoader.read_ahead`)."""
        return self.links.idle

    @idle.setter
    def idle(self, work: IdleWork | None) -> None:
        self.links.idle = work

    @property
    def messages_sent(self) -> int:
        """Point-to-point messages this stage has sent (with ``torch`` links, size announcements too)."""
        return self.links.messages_sent

    def begin_window(self, schedule: Schedule, first_index: int = 0) -> None:
        """Learn the order in which the neighbours will send during this window, whose subnet 0 is
        global subnet ``first_index`` (messages are keyed by global subnet)."""
        for link, peer in (("forward", self.stage - 1), ("backward", self.stage + 1)):
            if 0 <= peer < len(self.ranks):
                sends = [(first_index + i, c) for i, c in schedule.sends(peer, link)]
                if link == "forward" and self._flags_owed:  # sent after the previous window's messages
                    sends.insert(0, _FLAGS)
                    self._flags_owed = False
                self._expected[link] = sends[::-1]
                if sends:
                    self.links.post(peer)

    def end_window(self) -> None:
        """Take what the neighbours sent during this window and this stage has not used yet (forwards run
        ahead for the next window, see :mod:`.lookahead`), and wait until every message this stage sent
        has been delivered: the links are then empty between windows."""
        for link, peer in (("forward", self.stage - 1), ("backward", self.stage + 1)):
            expected = self._expected[link]
            while expected:
                self._buffer[link][expected.pop()] = self._recv(peer)
                if expected:
                    self.links.post(peer)
        self.links.flush()

    def drop_from(self, first_index: int) -> None:
        """Forget messages received for subnets ``first_index`` and later (a lookahead dropped)."""
        for buffer in self._buffer.values():
            for key in [key for key in buffer if key[0] >= first_index]:
                del buffer[key]

    def close(self) -> None:
        """Release the links (shared memory, FIFOs); the transport is unusable afterwards."""
        self.links.close()

    def send_activation(self, subnet: int, chunk: int, value: BlockValue) -> None:
        if self.first_activation is None:
            self.first_activation = describe(value)
        self.links.send(self.stage + 1, value)

    def recv_activation(self, subnet: int, chunk: int) -> BlockValue:
        return self._recv_for("forward", self.stage - 1, (subnet, chunk))

    def send_gradient(self, subnet: int, chunk: int, value: Gradients) -> None:
        self.links.send(self.stage - 1, value)

    def recv_gradient(self, subnet: int, chunk: int) -> Gradients:
        grads: Gradients = self._recv_for("backward", self.stage + 1, (subnet, chunk))  # as the sender sent them
        return grads

    def send_norms(self, subnet: int, stage: int, value: Any) -> None:
        """Send neighbour ``stage`` subnet ``subnet``'s norm message (see :mod:`.grad_norm`): it travels on
        the link in the order of the schedule's updates (``Schedule.sends``)."""
        self.links.send(stage, value)

    def recv_norms(self, subnet: int, stage: int) -> Any:
        """Neighbour ``stage``'s norm message of subnet ``subnet``."""
        link = "forward" if stage == self.stage - 1 else "backward"
        return self._recv_for(link, stage, (subnet, NORMS))

    def share(self, value: BlockValue) -> BlockValue:
        """The last stage's ``value`` (e.g. an evaluation output) on every stage: relayed down the links, each stage
        passing it on (called between windows, when the links hold nothing else that way). Point to point rather
        than a pickling broadcast over the group: on one host a shared-memory message per link, microseconds
        instead of milliseconds per evaluation batch."""
        if self.stage < len(self.ranks) - 1:
            value = self._recv(self.stage + 1)
        if self.stage > 0:
            self.links.send(self.stage - 1, value)
        return value

    def share_window_end(self, losses: Sequence[Tensor | None], flags: Sequence[int],
                         records: list[Any] | None = None) -> tuple[list[Tensor], list[int], list[Any]]:
        """At a window's end: the last stage's scalar losses on every stage, bit for bit, its ``records``
        (what ``compute_loss`` logged; tensors arrive on the host) and flags the stages agree on. Every
        stage passes as many flags, and every stage gets the same agreed ones.

        Point to point, not collectives, and nothing waits for an earlier stage: a stage finishes a
        window after the later ones (its last backward needs theirs), so the flags travel up the
        pipeline one window behind. Each stage ORs the flags the stage before sent at the end of the
        previous window into its own and sends them on; the last stage's are the agreed flags, and they
        come back down with its losses, each stage relaying them. A flag set on stage ``s`` is thus
        agreed at the end of the window ``num_stages - 1 - s`` windows later, on every stage alike.
        That is two messages per link, which shared memory moves in microseconds. The losses travel as
        ``[dtype code, loss0, loss1, ...]`` in float64, which holds float32, float16 and bfloat16 exactly.
        """
        last = len(self.ranks) - 1
        agreed = torch.tensor([int(bool(flag)) for flag in flags], dtype=torch.int64)
        if self.stage > 0:
            self._take_owed_flags()  # (a window without messages from the stage before)
            upstream = self._buffer["forward"].pop(_FLAGS, None)  # none at the first window's end
            if upstream is not None:
                agreed = torch.maximum(agreed, upstream.cpu())
            self._flags_owed = True
        if self.stage < last:
            self.links.send(self.stage + 1, agreed)
            message = self._recv(self.stage + 1)
        else:
            kept = [loss.detach().reshape(1) for loss in losses if loss is not None]
            code = torch.tensor([wire_format.CODE[kept[0].dtype] if kept else 0], dtype=torch.float64)
            packed = torch.cat([code] + [loss.to("cpu", torch.float64) for loss in kept])
            # Records only when there are some: a tuple of two tensors takes the wire's fast path.
            message = (packed, agreed, map_tensors(lambda t: t.detach().cpu(), records)) if records else (
                packed, agreed)
        if self.stage > 0:
            self.links.send(self.stage - 1, message)
        packed, agreed = message[0], message[1]
        dtype = wire_format.DTYPES[int(packed[0].item())]
        return ([v.to(dtype).to(self.device) for v in packed[1:]], [int(f) for f in agreed.tolist()],
                list(message[2]) if len(message) > 2 else [])

    def send_value(self, stage: int, value: BlockValue) -> None:
        """Send outside a window's schedule (evaluation); the peer must call :meth:`recv_value`."""
        self.links.send(stage, value)

    def recv_value(self, stage: int) -> BlockValue:
        if stage == self.stage - 1:  # evaluation between windows: the flags come first
            self._take_owed_flags()
        return self._recv(stage)

    def _take_owed_flags(self) -> None:
        if self._flags_owed:
            self._buffer["forward"][_FLAGS] = self._recv(self.stage - 1)
            self._flags_owed = False

    # -- messages -------------------------------------------------------------------------

    def _recv_for(self, link: str, stage: int, key: tuple[int, int]) -> Any:
        buffer = self._buffer[link]
        while key not in buffer:
            expected = self._expected[link]
            if not expected:
                raise RuntimeError(f"stage {self.stage} waits for {link} message {key} that the schedule never sends")
            buffer[expected.pop()] = self._recv(stage)
            if expected:  # the next one lands while this stage computes
                self.links.post(stage)
        return buffer.pop(key)

    def _recv(self, stage: int) -> Any:
        value = self.links.recv(stage)
        if self._wire == self.device:
            return value
        return map_tensors(lambda t: t.detach().to(self.device).requires_grad_(t.requires_grad), value)

    def _waited(self, seconds: float, end: float) -> None:
        self.wait_s += seconds
        if self.telemetry is not None:
            self.telemetry.waited(seconds, end)

    def _lost(self, stage: int | None, error: BaseException) -> StageFailure:
        if stage is None:
            return StageFailure(f"{self.names[self.ranks[self.stage]]} could not deliver a message to a neighbouring "
                                f"stage: it failed or exited ({error}).{explained(self.failures)}")
        return StageFailure(f"Pipeline {self.names[self.ranks[stage]]} failed or exited: it stopped sending ({error})."
                            + explained(self.failures, " See that process's own error output for the cause."))
