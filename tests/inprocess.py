"""A whole pipeline in one process: one thread per stage, messages through the real wire format.

The stage threads take turns: a thread holds the baton while it computes and gives it up only
while it waits for a message, so at most one stage runs torch code at a time (keyed randomness
seeds the global generator) and the run is deterministic. Each stage has its own
:class:`~lightning_naspipe.pipeline.runtime.engine.Engine` and runs its row of the same schedule, exactly as
stage processes do; only the transport differs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_naspipe.transport import wire
from lightning_naspipe.pipeline.runtime.engine import Engine, EngineModule
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.pipeline.offload.offload import Offloader
from lightning_naspipe.schedule.actions import NORMS, Schedule


class _World:
    def __init__(self, stages: int) -> None:
        self.baton = threading.Condition()
        self.queues: dict[tuple[int, int], list[Tensor]] = {}  # (from, to) -> packed messages, FIFO
        self.losses: list[Tensor | None] | None = None
        self.shared: list[Any] = []
        self.stages = stages
        self.failed = False  # a stage raised: the others stop waiting for it


class LocalTransport:
    """The :class:`~lightning_naspipe.pipeline.runtime.executor.Transport` of one stage thread."""

    # Threads of one process on the CPU: nothing to wait on that counts, no one to tell of a failure.
    device = torch.device("cpu")
    wait_s = 0.0
    first_activation: str | None = None
    failures = None
    idle: Callable[[], bool] | None = None  # receives never wait here for long

    def __init__(self, world: _World, stage: int) -> None:
        self.world, self.stage = world, stage
        self._expected: dict[int, list[tuple[int, int]]] = {}
        self._early: dict[int, dict[tuple[int, int], Any]] = {}

    def close(self) -> None:
        pass

    def begin_window(self, schedule: Schedule, first_index: int = 0) -> None:
        if self.stage > 0:
            self._expected[self.stage - 1] = [(first_index + i, c)
                                              for i, c in schedule.sends(self.stage - 1, "forward")]
        if self.stage < self.world.stages - 1:
            self._expected[self.stage + 1] = [(first_index + i, c)
                                              for i, c in schedule.sends(self.stage + 1, "backward")]

    def end_window(self) -> None:
        for frm, expected in self._expected.items():  # what was sent ahead for the next window
            early = self._early.setdefault(frm, {})
            while expected:
                early[expected.pop(0)] = self._take(frm)

    def drop_from(self, first_index: int) -> None:
        for early in self._early.values():
            for key in [key for key in early if key[0] >= first_index]:
                del early[key]

    def _put(self, to: int, value: Any) -> None:
        self.world.queues.setdefault((self.stage, to), []).append(wire.pack(value, torch.device("cpu")))
        self.world.baton.notify_all()

    def _take(self, frm: int) -> Any:
        queue = self.world.queues.setdefault((frm, self.stage), [])
        self.world.baton.wait_for(lambda: bool(queue) or self.world.failed, timeout=60)
        if not queue:
            raise RuntimeError(f"stage {self.stage} stopped waiting for stage {frm}: "
                               + ("another stage failed" if self.world.failed else "60 s, the schedule deadlocks"))
        return wire.unpack(queue.pop(0))

    def _take_for(self, frm: int, key: tuple[int, int]) -> Any:
        early = self._early.setdefault(frm, {})
        while key not in early:
            early[self._expected[frm].pop(0)] = self._take(frm)
        return early.pop(key)

    def send_activation(self, subnet: int, chunk: int, value: Any) -> None:
        self._put(self.stage + 1, value)

    def recv_activation(self, subnet: int, chunk: int) -> Any:
        return self._take_for(self.stage - 1, (subnet, chunk))

    def send_gradient(self, subnet: int, chunk: int, value: Any) -> None:
        self._put(self.stage - 1, value)

    def recv_gradient(self, subnet: int, chunk: int) -> Any:
        return self._take_for(self.stage + 1, (subnet, chunk))

    def send_value(self, stage: int, value: Any) -> None:
        self._put(stage, value)

    def send_norms(self, subnet: int, stage: int, value: Any) -> None:
        self._put(stage, value)

    def recv_norms(self, subnet: int, stage: int) -> Any:
        return self._take_for(stage, (subnet, NORMS))

    def recv_value(self, stage: int) -> Any:
        return self._take(stage)

    def share_window_end(self, losses: Sequence[Tensor | None], flags: Sequence[int],
                         records: list[Any] | None = None) -> tuple[list[Tensor], list[int], list[Any]]:
        return list(losses), list(flags), list(records or [])  # the driver reads the last stage's window

    def share(self, value: Any) -> Any:
        return value



def train_pipelined(module: EngineModule | Sequence[EngineModule], stage_blocks: Sequence[range],
                    batches: Sequence[Any], window: int, chunks: int = 1, schedule: str = "csp", lookahead: bool = True,
                    engines: list[Engine] | None = None, epoch_ends: Sequence[int] = (),
                    defer_weight_grads: bool | None = None, clip_norms: bool | None = None,
                    offload: bool = False) -> list[Tensor]:
    """Train ``batches`` through ``len(stage_blocks)`` stages in this process; the per-subnet losses.
    Each window is given the next one's batches, as the strategy does; ``engines`` (if given) is filled
    with the stage engines. Before each window starting at one of ``epoch_ends``, the window before
    was given other batches as its next (an epoch that ended early) and the lookahead is dropped.
    ``defer_weight_grads`` and ``clip_norms`` as for :class:`~lightning_naspipe.pipeline.runtime.engine.Engine`.
    ``module``: one the stages share, or one per stage (copies, as stage processes hold; ``offload``: each
    stage keeps its blocks in a host copy, see :class:`~lightning_naspipe.pipeline.offload.offload.Offloader`)."""
    modules = list(module) if isinstance(module, Sequence) else [module] * len(stage_blocks)
    world = _World(len(stage_blocks))
    built = [Engine(stage_blocks, stage=s, chunks=chunks, transport=LocalTransport(world, s), schedule=schedule,
                    lookahead=lookahead, defer_weight_grads=defer_weight_grads, clip_norms=clip_norms)
             for s in range(len(stage_blocks))]
    if offload:
        assert len({id(m) for m in modules}) == len(modules), "offloading stages need module copies of their own"
        for s, (engine, own) in enumerate(zip(built, modules)):
            engine.offloader = Offloader(own.supernet.stage_resources(stage_blocks[s]), own.optimizers().optimizer,
                                         torch.device("cpu"))
    if engines is not None:
        engines[:] = built
    losses: list[Tensor] = []
    errors: list[BaseException] = []

    threads_per_op = torch.get_num_threads()

    def stage_thread(engine: Engine, windows: list[Window], module: EngineModule) -> None:
        # OpenMP's thread count is per OS thread: a new thread would compute with the default count
        # (all cores), and kernels that split work across threads sum in another order.
        torch.set_num_threads(threads_per_op)
        with world.baton:
            try:
                for start in range(0, len(batches), window):
                    upcoming = batches[start + window:start + 2 * window]
                    if start + window in epoch_ends:
                        upcoming = upcoming[::-1]
                    if start in epoch_ends:
                        engine.drop_lookahead()
                    windows.append(engine.train_window(module, batches[start:start + window], start, upcoming))
            except BaseException as error:  # reported by the driver
                errors.append(error)
                world.failed = True
                world.baton.notify_all()

    results: list[list[Window]] = [[] for _ in built]
    threads = [threading.Thread(target=stage_thread, args=(e, r, m), daemon=True)
               for e, r, m in zip(built, results, modules)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    for w in results[-1]:
        losses += [loss for loss in w.losses if loss is not None]
    return losses
