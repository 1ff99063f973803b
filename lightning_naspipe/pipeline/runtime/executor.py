"""One stage's worker: runs its forward, backward and update actions in schedule order.

Every block boundary is a gradient boundary (see :mod:`.boundary`): a forward keeps each block's
input leaves and output, and a backward walks the blocks last to first.

The same executor runs the single-stage (sequential) path and every stage of the pipeline;
only the :class:`Transport` between stages differs, so the two paths cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
import time
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from lightning_naspipe.space.boundary import Gradients, backward_through, cut, device_of, leaf_grads
from lightning_naspipe.transport.failures import FailureBoard
from lightning_naspipe.transport.link import IdleWork
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.runtime.microbatch import Batch
from lightning_naspipe.pipeline.sampling.keyed import keyed_rng
from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule
from lightning_naspipe.pipeline.exactness.distillation import Teachers, wants_teacher
from lightning_naspipe.pipeline.exactness.loss_state import outside_state
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import BlockValue, Supernet, describe
from lightning_naspipe.pipeline.exactness.ties import TieRoutes
from lightning_naspipe.pipeline.exactness.weight_grads import DeferredWeights
from lightning_naspipe.pipeline.runtime.stage_run import StageRun
from lightning_naspipe.pipeline.runtime.window import Window


_T = TypeVar("_T")

# Randomness key of evaluation forwards: apart from every training subnet's (indices are >= 0).
EVALUATION_INDEX = -1
#: The block position in the key of ``compute_loss``'s randomness (blocks are 0, 1, ...).
LOSS_KEY = -1

#: Entered where a collaborator is absent (no replicas): one object, no allocation per micro-batch.
_NOTHING = contextlib.nullcontext()

_LOSS_CONTEXT: ContextVar[tuple[int, list[Any]] | None] = ContextVar("naspipe_loss_context", default=None)


def loss_context() -> tuple[int, list[Any]] | None:
    """While a training window's ``compute_loss`` runs: the subnet's global index and the window's
    :attr:`Window.records`, where the caller (the mixin's ``self.log``) may record what the plain run
    would do in that subnet's own step; ``None`` elsewhere."""
    return _LOSS_CONTEXT.get()


class Transport(Protocol):
    """Moves activations to the next stage and gradients to the previous one, one stage's end of the links
    (:class:`~lightning_naspipe.transport.p2p.P2PTransport` between stage processes)."""

    @property
    def device(self) -> torch.device:
        """Where received tensors are placed (the stage's compute device)."""
        ...

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for messages so far (the rest of a window's run is busy time)."""
        ...

    @property
    def first_activation(self) -> str | None:
        """The first activation this stage sent, in short (:func:`.supernet.describe`); ``None`` before one."""
        ...

    @property
    def failures(self) -> FailureBoard | None:
        """Where a failing stage posts its error for the others to name; ``None`` where no one reads it."""
        ...

    #: Work a receive may do while its message is not there yet (e.g. reading the next batches).
    idle: IdleWork | None

    def close(self) -> None:
        """Release the links; the transport is unusable afterwards."""
        ...

    def begin_window(self, schedule: Schedule, first_index: int) -> None: ...

    def end_window(self) -> None: ...

    def drop_from(self, first_index: int) -> None: ...

    def share(self, value: BlockValue) -> BlockValue: ...

    def share_window_end(self, losses: Sequence[Tensor | None], flags: Sequence[int],
                         records: list[Any] | None = None) -> tuple[list[Tensor], list[int], list[Any]]:
        """The last stage's losses and ``records``, and the flags the stages agree on, on every stage."""
        ...

    def send_activation(self, subnet: int, chunk: int, value: BlockValue) -> None: ...

    def recv_activation(self, subnet: int, chunk: int) -> BlockValue: ...

    def send_gradient(self, subnet: int, chunk: int, value: Gradients) -> None: ...

    def recv_gradient(self, subnet: int, chunk: int) -> Gradients: ...

    def send_value(self, stage: int, value: BlockValue) -> None: ...

    def recv_value(self, stage: int) -> BlockValue: ...

    def send_norms(self, subnet: int, stage: int, value: Any) -> None:
        """Send a neighbouring ``stage`` subnet ``subnet``'s gradient-norm message (see :mod:`.grad_norm`)."""
        ...

    def recv_norms(self, subnet: int, stage: int) -> Any:
        """The gradient-norm message of subnet ``subnet`` from a neighbouring ``stage``."""
        ...


class StageModule(Protocol):
    """What the executor needs from the user's module (the mixin provides it)."""

    supernet: Supernet

    def pipeline_input(self, batch: Batch) -> BlockValue: ...

    def compute_loss(self, output: BlockValue, batch: Batch) -> Tensor: ...

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None: ...


class StageExecutor:
    """Executes one stage's share of each window; the engine builds it once (again only when the stage's
    blocks or transport change) and gives each run its :class:`.StageRun`.

    Args:
        module: the user's LightningModule (with the mixin).
        stage: this stage's position, 0-based.
        num_stages: the number of pipeline stages.
        blocks: the global indices of the supernet blocks this stage runs.
        seed: the run's seed, keying each block's randomness.
        transport: how tensors reach neighbouring stages; unused with one stage.
        stash: where forwards keep what their backward needs, by global ``(subnet, chunk)``; it outlives a
            window when forwards run ahead (see :mod:`.lookahead`).
        teachers: where the last stage keeps each step's teacher outputs (in-place distillation).
    """

    def __init__(self, *, module: StageModule, stage: int, num_stages: int, blocks: range, seed: int,
                 transport: Transport | None = None, stash: dict[tuple[int, int], list[tuple[Any, Any]]] | None = None,
                 teachers: Teachers | None = None) -> None:
        if num_stages > 1 and transport is None:
            raise ValueError("a multi-stage executor needs a transport")
        self.module = module
        self.stage = stage
        self.blocks = blocks
        self.seed = seed
        self.transport = transport
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        # (global subnet, chunk) -> per block (input, output); the last block's output is replaced by
        # the weighted loss on the last stage. Kept for backward.
        self._stash = {} if stash is None else stash
        self._teachers = Teachers() if teachers is None else teachers
        self._teacher_parameter: bool | None = None
        self._run = StageRun()
        #: Per backward of the last run, seconds from having its output gradients to sending its input gradients.
        self.seconds_to_send: list[float] = []

    def run(self, actions: Sequence[Action], window: Window, update: Callable[[int], None],
            stage_run: StageRun) -> None:
        """Run ``actions`` in order with ``stage_run``'s collaborators; ``update(k)`` steps the optimizer for
        window subnet ``k``."""
        self._run, self.seconds_to_send = stage_run, []
        telemetry = stage_run.telemetry
        for action in actions:
            if telemetry is not None:
                telemetry.start_action()
                start = time.perf_counter()
            if action.kind == FORWARD:
                if stage_run.residency is not None and action.chunk == 0:
                    stage_run.residency.before_forward(action.subnet)
                self._forward(window, action.subnet, action.chunk)
            elif action.kind == BACKWARD:
                self._backward(window, action.subnet, action.chunk)
            elif action.kind == UPDATE:
                update(action.subnet)
                index = window.first_index + action.subnet
                self._teachers.drop_from(index, index)
            else:  # pragma: no cover - the scheduler only emits the three kinds
                raise ValueError(f"unknown action {action}")
            if telemetry is not None:
                telemetry.action(str(action), action.kind, action.subnet, start, time.perf_counter())

    def forward_only(self, batch: Batch, architecture: Architecture, stage_run: StageRun) -> BlockValue:
        """This stage's part of an evaluation forward; the output on the last stage, else ``None``."""
        self._run = stage_run
        x, passing = self._stage_input(batch, lambda: self._transport.recv_value(self.stage - 1), 0, stage_run.ties)
        for _, x in self._run_blocks(x, architecture, EVALUATION_INDEX, 0):
            pass
        if self.is_last:
            return x
        self._transport.send_value(self.stage + 1, self._with_tied_values(0, x, passing, stage_run.ties))
        return None

    @property
    def _transport(self) -> Transport:
        assert self.transport is not None, "only the first stage has no predecessor, only the last no successor"
        return self.transport

    def _stage_input(self, piece: Batch, receive: Callable[[], BlockValue], k: int,
                     ties: TieRoutes | None) -> tuple[Any, dict[int, Tensor]]:
        """The first block's input (from the data on the first stage, else received) and the tied values that
        came with it."""
        if self.is_first:
            return self.module.pipeline_input(piece), {}
        x = receive()
        return ties.take_values(k, x) if ties is not None else (x, {})

    @staticmethod
    def _with_tied_values(k: int, y: Any, passing: dict[int, Tensor], ties: TieRoutes | None) -> Any:
        return y if ties is None else ties.with_values(k, y, passing)

    def _run_blocks(self, x: Any, architecture: Architecture, index: int, chunk: int) -> Iterator[tuple[Any, Any]]:
        """Each block's ``(input, output)``; a block's input is its predecessor's output, :func:`cut`
        (the first block's is ``x``, fresh from the data or the transport)."""
        device = device_of(x)
        supernet = self.module.supernet
        for n, block in enumerate(self.blocks):
            if n > 0:
                x = cut(x)
            with keyed_rng(device, self.seed, index, block, chunk):
                try:
                    y = supernet.run_block(block, x, architecture)
                except RuntimeError as error:
                    if "leaf Variable that requires grad" in str(error):
                        raise NASPipeConfigError(
                            f"Block {block} modifies its input in place (e.g. nn.ReLU(inplace=True) as its first op). "
                            "Every block's input is a gradient leaf, so use inplace=False for the op that first "
                            "touches the block's input."
                        ) from error
                    raise
            yield x, y
            x = y

    def _forward(self, window: Window, k: int, c: int) -> None:
        replicas = self._run.replicas
        index, m = window.first_index + k, self._run.chunk_offset + c
        with replicas.forward(index, m) if replicas is not None else _NOTHING:
            self._forward_chunk(window, k, c)

    def _forward_chunk(self, window: Window, k: int, c: int) -> None:
        m = self._run.chunk_offset + c
        architecture, piece, weight, subnet, chunk = window.micro_batch(k, m)
        index = window.first_index + k
        ties = self._run.ties if c == 0 else None  # tied values travel with a subnet's first activation
        x, passing = self._stage_input(piece, lambda: self._transport.recv_activation(index, c), k, ties)
        saved = list(self._run_blocks(x, architecture, index, m))
        if self.is_last:  # the last block's output is replaced by the weighted loss, backward's start
            loss = self._weighted_loss(window, saved[-1][1], piece, weight, k, m, subnet, chunk, device_of(x))
            saved[-1] = (saved[-1][0], loss)
        else:
            self._transport.send_activation(index, c, self._with_tied_values(k, saved[-1][1], passing, ties))
        self._stash[(index, c)] = saved

    def _weighted_loss(self, window: Window, y: Any, piece: Any, weight: float, k: int, m: int, subnet: int,
                       chunk: int, device: torch.device) -> Tensor:
        """Micro-batch ``m``'s ``compute_loss`` of subnet ``k``, weighted by its share of the batch and kept in
        ``window.chunk_losses``."""
        index = window.first_index + k
        token = _LOSS_CONTEXT.set((index, window.records))
        try:
            # Keyed like a block: randomness in the loss (torch's, Python's, NumPy's) depends on the subnet and
            # micro-batch only, not on what this process ran before (other stages' blocks, other replicas').
            loss = self._loss(window, y, piece, index, m - self._run.chunk_offset, subnet, chunk,
                              keyed_rng(device, self.seed, index, LOSS_KEY, m))
        finally:
            _LOSS_CONTEXT.reset(token)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(f"compute_loss must return a scalar tensor, got {describe(loss)}.")
        if len(window.pieces[k]) > 1:
            loss = loss * weight
        window.chunk_losses[k][m] = loss.detach()
        return loss

    def _loss(self, window: Window, y: Any, piece: Any, index: int, c: int, subnet: int, chunk: int,
              keyed: contextlib.AbstractContextManager[None]) -> Any:
        """``compute_loss`` of the last block's output ``y``, inside ``keyed``; in-place distillation's teacher kept
        and passed on (outside it: that may wait for a message)."""
        # On several processes compute_loss runs on the last stage only: what it changes outside the supernet
        # would differ from the plain run's module, so it is refused (see loss_state.py).
        watch = outside_state(self.module) if self.transport is not None or self._run.replicas is not None else None
        before = watch.snapshot() if watch is not None else None
        if not self._wants_teacher():
            with keyed:
                loss = self.module.compute_loss(y, piece)
        else:
            k = index - window.first_index  # in-place distillation: the step's first subnet teaches the others
            if len(window.steps[k]) > 1:
                self._teachers.relay(index, c, len(window.pieces[k]), self._run.chunk_offset)
                if subnet == 0:
                    self._teachers.keep(index, chunk, y)
            teacher = self._teachers.teacher(index, chunk) if subnet else None
            with keyed:
                loss = self.module.compute_loss(y, piece, teacher=teacher)  # type: ignore[call-arg]
        if watch is not None and before is not None:
            watch.refuse_changes(before)
        return loss

    def _backward(self, window: Window, k: int, c: int) -> None:
        """Backward block by block, last to first: each block's outputs get the gradients its
        successor's input leaves collected (see :mod:`.boundary`). With deferred weight gradients, they are
        computed after the input gradients are sent."""
        replicas = self._run.replicas
        index, m = window.first_index + k, self._run.chunk_offset + c
        with replicas.backward(index, m) if replicas is not None else _NOTHING:
            self._backward_chunk(window, k, c)

    def _backward_chunk(self, window: Window, k: int, c: int) -> None:
        index = window.first_index + k
        saved = self._stash.pop((index, c))
        defer = self._run.defer_weight_grads and not self.is_first
        deferred = DeferredWeights(self._collect) if defer else None
        architecture = window.micro_batch(k, self._run.chunk_offset + c)[0]
        contributions: list[Tensor | None] = []  # to parameters tied to an earlier stage's (see ties.py)
        blocks = reversed(self.blocks)
        block, (inputs, outputs) = next(blocks), saved.pop()
        if self.is_last:
            start = time.perf_counter()
            # Lightning's precision plugins scale the loss here
            self._capturing(k, block, contributions, lambda: self.module.manual_backward(outputs))
            grads, passing = leaf_grads(inputs), list[Any]()
        else:
            received, passing = self._output_grads(index, k, c)
            start = time.perf_counter()
            grads = self._capturing(k, block, contributions, lambda: self._block_backward(
                outputs, received, inputs, architecture, block, deferred))
        for block in blocks:
            inputs, outputs = saved.pop()
            grads = self._capturing(k, block, contributions, lambda: self._block_backward(
                outputs, grads, inputs, architecture, block, deferred))
        if not self.is_first:
            self.seconds_to_send.append(time.perf_counter() - start)
            ties = self._run.ties
            self._transport.send_gradient(index, c, grads if ties is None else ties.with_grads(
                k, grads, passing, contributions))
        if deferred is not None:
            deferred.run()

    def _output_grads(self, index: int, k: int, c: int) -> tuple[Gradients, list[Any]]:
        """The gradients of this stage's output, received from the next stage, and the tied gradients that
        pass through to an earlier one."""
        received = self._transport.recv_gradient(index, c)
        ties = self._run.ties
        return ties.take_grads(k, received, self._collect) if ties is not None else (received, [])

    def _wants_teacher(self) -> bool:
        if self._teacher_parameter is None:
            self._teacher_parameter = wants_teacher(self.module)
        return self._teacher_parameter

    def _capturing(self, k: int, block: int, contributions: list[Tensor | None], backward: Callable[[], _T]) -> _T:
        """``backward()`` of ``block``; with a copy of a parameter tied to an earlier stage's in it, that copy's
        ``.grad`` is the block's contribution alone, taken into ``contributions`` (the copy keeps no gradient)."""
        ties = self._run.ties
        tensors = ties.captured(k, block) if ties is not None else []
        kept = [t.grad for t in tensors]  # None in a stage process; the owner's, when stages share a module
        for t in tensors:
            t.grad = None
        try:
            return backward()
        finally:
            contributions.extend(t.grad for t in tensors)
            for t, grad in zip(tensors, kept):
                t.grad = grad
            self._collect()  # the block's backward call was one accumulation

    def _collect(self) -> None:
        """After one accumulation onto ``.grad``: a later replica keeps it as an addend of its own (see
        :meth:`.ReplicaUpdates.collect`)."""
        if self._run.replicas is not None:
            self._run.replicas.collect()

    def _block_backward(self, outputs: Any, grads: Sequence[Tensor | None], inputs: Any,
                        architecture: Architecture, block: int,
                        deferred: DeferredWeights | None) -> tuple[Tensor | None, ...]:
        if deferred is None:
            backward_through(outputs, grads)
            return leaf_grads(inputs)
        supernet = self.module.supernet
        params: list[Tensor] = [p for r in sorted(supernet.resources((block,), architecture))
                                for p in supernet.resource_state(r).params]
        ties = self._run.ties
        if ties is not None:  # a tied copy's contribution is sent before the weight passes: one pass for it
            params = ties.ties.owned(self.stage, params)
        return deferred.backward(outputs, grads, inputs, params)
