"""Stages x data-parallel replicas in one process: a thread per (stage, replica), each with its own module copy, the
stages of a replica linked as in :mod:`inprocess`, the replicas of a stage by a :class:`BatonGroup`. One baton for
all threads, so at most one runs torch code at a time and the run is deterministic."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from inprocess import LocalTransport, _World
from lightning_naspipe.pipeline.runtime.engine import Engine, EngineModule


class _Links:
    def __init__(self, baton: threading.Condition) -> None:
        self.baton = baton
        self.queues: dict[tuple[int, int, int], list[Any]] = {}  # (stage, from, to) -> values, FIFO


class BatonGroup:
    """A :class:`~lightning_naspipe.pipeline.exactness.replicas.ReplicaGroup` of the replica threads of one stage; its
    messages
    take the ways :class:`~lightning_naspipe.transport.replica_links.ReplicaLinks` takes."""

    wait_s = 0.0
    failures = None

    def __init__(self, links: _Links, stage: int, replica: int, replicas: int) -> None:
        self._links, self._stage, self._replica, self._replicas = links, stage, replica, replicas

    @property
    def replica(self) -> int:
        return self._replica

    @property
    def replicas(self) -> int:
        return self._replicas

    def _send(self, to: int, value: Any) -> None:
        self._links.queues.setdefault((self._stage, self._replica, to), []).append(value)
        self._links.baton.notify_all()

    def _recv(self, frm: int) -> Any:
        queue = self._links.queues.setdefault((self._stage, frm, self._replica), [])
        self._links.baton.wait_for(lambda: bool(queue), timeout=60)
        if not queue:
            raise RuntimeError(f"stage {self._stage} replica {self._replica} waited 60 s for replica {frm}")
        return queue.pop(0)

    def send_next(self, value: Any) -> None:
        self._send(self._replica + 1, value)

    def recv_previous(self) -> Any:
        return self._recv(self._replica - 1)

    def send_previous(self, value: Any) -> None:
        self._send(self._replica - 1, value)

    def recv_next(self) -> Any:
        return self._recv(self._replica + 1)

    def from_last(self, value: Any) -> Any:
        if self._replica != self._replicas - 1:
            value = self._recv(self._replica + 1)
        if self._replica > 0:
            self._send(self._replica - 1, value)
        return value

    def gather(self, value: Any) -> list[Any]:
        parts = [value] if self._replica == 0 else [*self._recv(self._replica - 1), value]
        if self._replica < self._replicas - 1:
            self._send(self._replica + 1, parts)
        return list(self.from_last(parts if self._replica == self._replicas - 1 else None))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SharingTransport(LocalTransport):
    """A stage thread's transport that relays the last stage's evaluation output to every stage, as
    :meth:`~lightning_naspipe.transport.p2p.P2PTransport.share` does (``LocalTransport`` leaves that to the driver)."""

    def share(self, value: Any) -> Any:
        if self.stage < self.world.stages - 1:
            value = self._take(self.stage + 1)
        if self.stage > 0:
            self._put(self.stage - 1, value)
        return value


def _grid(stage_blocks: Sequence[range], replicas: int, chunks: int,
          **engine_kwargs: Any) -> tuple[list[list[Engine]], threading.Condition]:
    """Engines of ``len(stage_blocks)`` stages x ``replicas`` linked as stage processes are, ``built[s][r]``, and
    the baton they share."""
    stages = len(stage_blocks)
    baton = threading.Condition()
    links = _Links(baton)
    columns = []
    for _ in range(replicas):
        world = _World(stages)
        world.baton = baton
        columns.append(world)
    return [[Engine(stage_blocks, stage=s, chunks=chunks,
                    transport=_SharingTransport(columns[r], s) if stages > 1 else None,
                    replicas=BatonGroup(links, s, r, replicas) if replicas > 1 else None, **engine_kwargs)
             for r in range(replicas)] for s in range(stages)], baton


def _run(built: list[list[Engine]], baton: threading.Condition, work: Callable[[int, int], None]) -> None:
    """``work(s, r)`` on a thread per engine of ``built``, each holding ``baton`` while it computes."""
    errors: list[BaseException] = []
    threads_per_op = torch.get_num_threads()

    def run(s: int, r: int) -> None:
        torch.set_num_threads(threads_per_op)
        with baton:
            try:
                work(s, r)
            except BaseException as error:  # noqa: BLE001 - raised by the driver
                errors.append(error)
                baton.notify_all()

    threads = [threading.Thread(target=run, args=(s, r), daemon=True)
               for s in range(len(built)) for r in range(len(built[0]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a replica thread hangs"


def train_grid(modules: Sequence[Sequence[EngineModule]], stage_blocks: Sequence[range], batches: Sequence[Any],
               window: int, chunks: int, engines: list[list[Engine]] | None = None,
               **engine_kwargs: Any) -> list[list[Tensor | None]]:
    """Train ``batches`` on ``len(stage_blocks)`` stages x ``len(modules[0])`` replicas; ``modules[s][r]``: stage
    ``s`` replica ``r``'s copy. Each window is given the next one's batches. Returns each replica's last-stage losses.
    ``engines`` (if given) is filled with the engines, ``engines[s][r]``; ``engine_kwargs``: as for :class:`Engine`."""
    stages, replicas = len(stage_blocks), len(modules[0])
    built, baton = _grid(stage_blocks, replicas, chunks, **engine_kwargs)
    if engines is not None:
        engines[:] = built
    losses: list[list[Tensor | None]] = [[] for _ in range(replicas)]

    def work(s: int, r: int) -> None:
        for start in range(0, len(batches), window):
            upcoming = batches[start + window:start + 2 * window]
            done = built[s][r].train_window(modules[s][r], batches[start:start + window], start, upcoming)
            if s == stages - 1:
                losses[r] += done.losses

    _run(built, baton, work)
    return losses


def evaluate_grid(modules: Sequence[Sequence[EngineModule]], stage_blocks: Sequence[range], batches: Sequence[Any],
                  architectures: Sequence[dict[str, int]],
                  engines: list[list[Engine]] | None = None) -> list[list[list[Any]]]:
    """Evaluate ``batches[k]`` under ``architectures[k]`` on stages x replicas as the strategy shards evaluation:
    groups of as many batches as replicas (the last may be shorter), one forward per replica
    (:meth:`Engine.evaluate_shard`). Returns ``outputs[s][r]``: every output, in batch order, on stage ``s``
    replica ``r``; ``engines`` as for :func:`train_grid`."""
    replicas = len(modules[0])
    built, baton = _grid(stage_blocks, replicas, 1)
    if engines is not None:
        engines[:] = built
    outputs: list[list[list[Any]]] = [[[] for _ in range(replicas)] for _ in stage_blocks]

    def work(s: int, r: int) -> None:
        for start in range(0, len(batches), replicas):
            count = min(replicas, len(batches) - start)
            mine = r < count
            outputs[s][r] += built[s][r].evaluate_shard(modules[s][r], count, batches[start + r] if mine else None,
                                                        architectures[start + r] if mine else None,
                                                        torch.device("cpu"))

    _run(built, baton, work)
    return outputs


def assert_grid_equals(losses: Sequence[Tensor], expected: dict[str, Tensor], found: Sequence[Sequence[Tensor]],
                       grid: Sequence[Sequence[Any]], stage_blocks: Sequence[range]) -> None:
    """Every replica's losses are ``losses`` and every stage's blocks hold ``expected`` (the one-device state dict),
    bit for bit; ``found`` and ``grid`` as :func:`train_grid` returns and takes them."""
    for r in range(len(grid[0])):
        assert all(torch.equal(a, b) for a, b in zip(losses, found[r], strict=True)), f"replica {r}'s losses"
        for s, blocks in enumerate(stage_blocks):
            state = grid[s][r].supernet.state_dict()
            differ = [k for k in state if int(k.split(".")[1]) in blocks and not torch.equal(state[k], expected[k])]
            assert not differ, f"stage {s} replica {r}: {differ}"
