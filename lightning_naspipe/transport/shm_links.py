"""Messages between stage processes on one host, through shared memory.

gloo moves a point-to-point message over loopback TCP with threads of its own: on a small host
that took ~0.7 ms from send to the receiver's wake-up for 64 KiB, and CPU time beside the compute.
Here the sender packs the value (see :mod:`.wire`) straight into a memory-mapped ring that the
receiver maps too, and a FIFO carries a 24-byte note per message: a receive is a ``read`` of the
note (``poll`` while there is none) and one copy out of the ring (~0.06 ms for 64 KiB).

Per directed link ``src -> dst`` (files under ``/dev/shm``, named after a folder of the run)::

    <run>/notes-src-dst     FIFO src -> dst: (ring id, start, bytes) per message
    <run>/acks-src-dst      FIFO dst -> src: (ring id, end) per message consumed: that space is free
    <run>-ring-src-dst-<id> written by src; a message that does not fit in its free space starts a
                            ring twice the size, so a sender never waits and no schedule can deadlock

The FIFOs and their folder are removed once every end is open, and a ring once its receiver has
mapped it, so even a killed run leaves nothing behind but a ring nobody read. A stage process that
exits closes its end of the notes FIFO: the receiver's wait ends at once, not at the timeout.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_naspipe.space.supernet import BlockValue
from lightning_naspipe.transport import wire as wire_format
from lightning_naspipe.transport.distributed import broadcast_object
from lightning_naspipe.transport.link import IdleWork, LostHandler, WaitHandler

try:
    import fcntl
except ImportError:  # not Unix: same_host() says no before anything here runs
    fcntl = None  # type: ignore[assignment]

SHARED_MEMORY = "/dev/shm"
_NOTE = struct.Struct("<qqq")  # ring id, start, bytes
_ACK = struct.Struct("<qq")  # ring id, end
_ALIGN = 64  # every message starts on a cache line
_FIRST_RING = 4 << 20
_F_SETPIPE_SZ = 1031  # <linux/fcntl.h>: room for tens of thousands of notes
_PIPE_BYTES = 1 << 20


class _Ring:
    """A memory-mapped file of ``size`` bytes (created, or opened and unlinked by its receiver)."""

    def __init__(self, path: str, size: int = 0) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size else 0), 0o600)
        try:
            if size:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
                os.unlink(path)  # both ends have it mapped from here on
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.bytes: Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, start: int, nbytes: int) -> Tensor:
        assert self.bytes is not None
        offset = start % self.size
        return self.bytes[offset: offset + nbytes]

    def close(self) -> None:
        self.bytes = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass


class SharedMemoryLinks:
    """One stage's links to its neighbours on the same host (see the module docstring).

    Build with :meth:`connect` (collective over all stage processes). Arguments as for
    :class:`~.torch_links.TorchLinks`; ``folder`` names the run's files (:func:`_path`) and ``fds``
    holds the FIFO ends, ``fds[("notes" | "acks", src, dst)]``. A receive polls the link without
    sleeping for up to ``spin_s`` seconds first: a process asleep in ``poll`` wakes some tens of
    microseconds after the note lands (on a VM, its idle vCPU too), on every message. Only worth it,
    and only fair, on cores this process has to itself.
    """

    def __init__(self, stage: int, folder: str, fds: dict[tuple[str, int, int], int], timeout: timedelta,
                 waited: WaitHandler, lost: LostHandler, spin_s: float = 0.0) -> None:
        self.stage = stage
        self.spin_s = spin_s
        self.folder = folder
        self.timeout = timeout
        self._fds = fds
        self._waited = waited
        self._lost = lost
        # Outgoing, per peer stage: the ring, its id, the next free and the oldest unconsumed byte.
        self._ring: dict[int, _Ring] = {}
        self._ring_id: dict[int, int] = {}
        self._head: dict[int, int] = {}
        self._tail: dict[int, int] = {}
        # Incoming, per peer stage: the ring being read, with its id.
        self._reading: dict[int, tuple[int, _Ring]] = {}
        self._polls: dict[int, Any] = {}
        for (kind, src, dst), fd in fds.items():
            if kind == "notes" and dst == stage:
                self._polls[src] = select.poll()
                self._polls[src].register(fd, select.POLLIN)
        #: Messages sent.
        self.messages_sent = 0
        #: Work to do while a receive would wait (:data:`~.torch_links.IdleWork`), set by the transport's owner.
        self.idle: IdleWork | None = None

    @classmethod
    def connect(cls, stage: int, ranks: Sequence[int], timeout: timedelta, waited: WaitHandler,
                lost: LostHandler, spin_s: float = 0.0, group: Any = None) -> SharedMemoryLinks:
        """Open this stage's links (collective: every process calls it; ``group``: the process group of
        ``ranks`` where other pipelines, data-parallel replicas of this one, connect at the same time)."""
        folder = tempfile.mkdtemp(prefix="naspipe-", dir=SHARED_MEMORY) if stage == 0 else None
        folder = broadcast_object(folder, ranks[0], torch.device("cpu"), group)
        peers = [p for p in (stage - 1, stage + 1) if 0 <= p < len(ranks)]
        fds: dict[tuple[str, int, int], int] = {}
        # This stage reads the notes coming in and the acks of what it sends: it makes those FIFOs.
        mine = [key for p in peers for key in (("notes", p, stage), ("acks", stage, p))]
        for key in mine:
            os.mkfifo(_path(folder, *key), 0o600)
            fds[key] = os.open(_path(folder, *key), os.O_RDONLY | os.O_NONBLOCK)
        dist.barrier()
        for key in (k for p in peers for k in (("notes", stage, p), ("acks", p, stage))):
            fds[key] = os.open(_path(folder, *key), os.O_WRONLY | os.O_NONBLOCK)
            try:
                assert fcntl is not None
                fcntl.fcntl(fds[key], _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:  # a lower system limit: the default 64 KiB holds thousands of notes
                pass
        dist.barrier()
        for key in mine:
            os.unlink(_path(folder, *key))
        dist.barrier()
        if stage == 0:
            os.rmdir(folder)  # empty now; the rings are named after it, outside it
        return cls(stage, folder, fds, timeout, waited, lost, spin_s)

    def send(self, stage: int, value: BlockValue) -> None:
        """Write ``value`` into the ring to ``stage`` and note it; never waits for the receiver."""
        self._take_acks(stage)
        placed: list[tuple[int, int]] = []

        def allocate(nbytes: int) -> Tensor:
            start = self._reserve(stage, nbytes)
            placed.append((start, nbytes))
            return self._ring[stage].view(start, nbytes)

        wire_format.pack(value, torch.device("cpu"), allocate)
        start, nbytes = placed[0]
        self._write(stage, _NOTE.pack(self._ring_id[stage], start, nbytes))
        self.messages_sent += 1

    def post(self, stage: int) -> None:
        """Nothing to post: a message is in shared memory as soon as it is sent."""

    def recv(self, stage: int) -> BlockValue:
        """The next value from ``stage``, copied out of shared memory."""
        ring_id, start, nbytes = _NOTE.unpack(self._read_note(stage))
        reading = self._reading.get(stage)
        if reading is None or reading[0] != ring_id:  # the sender started a new ring: the old one is done
            if reading is not None:
                reading[1].close()
            reading = self._reading[stage] = (ring_id, _Ring(_path(self.folder, "ring", stage, self.stage, ring_id)))
        message = reading[1].view(start, nbytes).clone()
        try:
            end = start + wire_format.aligned(nbytes, _ALIGN)
            os.write(self._fds[("acks", stage, self.stage)], _ACK.pack(ring_id, end))
        except (BlockingIOError, BrokenPipeError):  # a later ack supersedes it; a gone sender shows on receive
            pass
        return wire_format.unpack(message)

    def flush(self) -> None:
        """Nothing to wait for: sent messages are in shared memory."""

    def close(self) -> None:
        """Close the FIFOs and unmap the rings (and remove one its receiver never read from)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for stage, ring in self._ring.items():
            ring.close()
            try:
                os.unlink(_path(self.folder, "ring", self.stage, stage, self._ring_id[stage]))
            except FileNotFoundError:  # the receiver mapped it
                pass
        for _, ring in self._reading.values():
            ring.close()
        self._ring.clear()
        self._reading.clear()

    # -- outgoing ---------------------------------------------------------------------------------

    def _reserve(self, stage: int, nbytes: int) -> int:
        """Where a message of ``nbytes`` starts in the ring to ``stage`` (a new ring if it does not fit)."""
        size = wire_format.aligned(nbytes, _ALIGN)
        ring = self._ring.get(stage)
        if ring is not None:
            start = self._head[stage]
            if start % ring.size + size > ring.size:  # no wrapping inside a message
                start += ring.size - start % ring.size
            if start + size - self._tail[stage] <= ring.size:
                self._head[stage] = start + size
                return start
        new_size = max(_FIRST_RING, 2 * ring.size if ring is not None else 0, 1 << (4 * size - 1).bit_length())
        ring_id = self._ring_id.get(stage, -1) + 1
        if ring is not None:  # the receiver still maps the file by name; it unlinks it
            ring.close()
        self._ring[stage] = _Ring(_path(self.folder, "ring", self.stage, stage, ring_id), new_size)
        self._ring_id[stage], self._head[stage], self._tail[stage] = ring_id, size, 0
        return 0

    def _take_acks(self, stage: int) -> None:
        try:
            acks = os.read(self._fds[("acks", self.stage, stage)], 1 << 16)
        except BlockingIOError:
            return
        for ring_id, end in _ACK.iter_unpack(acks):
            if ring_id == self._ring_id.get(stage):
                self._tail[stage] = max(self._tail[stage], end)

    def _write(self, stage: int, note: bytes) -> None:
        fd = self._fds[("notes", self.stage, stage)]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                os.write(fd, note)
                return
            except BrokenPipeError as error:
                raise self._lost(stage, error) from error
            except BlockingIOError:  # the receiver is tens of thousands of messages behind
                if time.monotonic() > deadline:
                    raise self._lost(stage, TimeoutError(f"it read no message for {self.timeout}")) from None
                select.select([], [fd], [], 1.0)

    # -- incoming ---------------------------------------------------------------------------------

    def _read_note(self, stage: int) -> bytes:
        fd = self._fds[("notes", stage, self.stage)]
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout.total_seconds()
        spin_until = start + self.spin_s
        worked, idle = 0.0, self.idle
        while True:
            try:
                note = os.read(fd, _NOTE.size)
            except BlockingIOError:
                if idle is not None:
                    began = time.perf_counter()
                    if idle():
                        worked += time.perf_counter() - began
                        continue
                    idle = None  # nothing more to do in this wait
                if time.perf_counter() < spin_until + worked:
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._lost(stage, TimeoutError(f"no message for {self.timeout}")) from None
                self._polls[stage].poll(min(remaining, 1.0) * 1000)
                continue
            if not note:
                raise self._lost(stage, EOFError("its process closed the link"))
            end = time.perf_counter()
            self._waited(end - start - worked, end)
            return note


def same_host(world_size: int) -> bool:
    """Whether every stage process runs on this host and can share memory (collective)."""
    from lightning_naspipe.transport.distributed import gather_objects

    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            host: Any = (os.uname().nodename, boot.read().strip(), os.path.isdir(SHARED_MEMORY))
    except OSError:  # not Linux
        host = None
    hosts = gather_objects(host, world_size)
    return hosts[0] is not None and hosts[0][2] and all(h == hosts[0] for h in hosts)


def _path(folder: str, kind: str, src: int, dst: int, ring_id: int | None = None) -> str:
    if ring_id is None:  # a FIFO, inside the run's folder
        return os.path.join(folder, f"{kind}-{src}-{dst}")
    return f"{folder}-{kind}-{src}-{dst}-{ring_id}"
