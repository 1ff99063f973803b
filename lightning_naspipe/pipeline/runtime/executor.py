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
from lightning_naspipe.pipeline.exactness.replicas import ReplicaUpdates
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import BlockValue, Supernet, describe
from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry
from lightning_naspipe.pipeline.exactness.ties import TieRoutes
from lightning_naspipe.pipeline.exactness.weight_grads import DeferredWeights
from lightning_naspipe.pipeline.runtime.window import Window


_T = TypeVar("_T")

# Randomness key of evaluation forwards: apart from every training subnet's (indices are >= 0).
EVALUATION_INDEX = -1
#: The block position in the key of ``compute_loss``'s randomness (blocks are 0, 1, ...).
LOSS_KEY = -1

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
    """Executes one stage's share of a window.

    Args:
        module: the user's LightningModule (with the mixin).
        stage: this stage's position, 0-based.
        num_stages: the number of pipeline stages.
        blocks: the global indices of the supernet blocks this stage runs.
        seed: the run's seed, keying each block's randomness.
        transport: how tensors reach neighbouring stages; unused with one stage.
        telemetry: records the actions' timeline, if given.
        stash: where forwards keep what their backward needs, by global ``(subnet, chunk)``; pass the
            same one to the next window's executor when forwards run ahead (see :mod:`.lookahead`).
        defer_weight_grads: send a backward's input gradients before computing its weight gradients
            (see :mod:`.weight_grads`); ignored on the first stage, which sends none.
        ties: how this stage moves the values and gradients of parameters tied across stages (:mod:`.ties`);
            ``None`` when no parameter spans stages.
        chunk_offset: the first micro-batch this replica trains (:meth:`.Layout.chunk_share`): action chunk
            ``c`` is micro-batch ``chunk_offset + c`` of the subnet's batch.
        replicas: with several replicas per stage, this replica's part of their exact reduction.
        teachers: where the last stage keeps each step's teacher outputs (in-place distillation); pass the same
            one to the next window's executor, as ``stash``.
    """

    def __init__(
        self,
        module: StageModule,
        stage: int,
        num_stages: int,
        blocks: range,
        seed: int,
        transport: Transport | None = None,
        telemetry: StageTelemetry | None = None,
        stash: dict[tuple[int, int], list[tuple[Any, Any]]] | None = None,
        defer_weight_grads: bool = False,
        ties: TieRoutes | None = None,
        chunk_offset: int = 0,
        replicas: ReplicaUpdates | None = None,
        teachers: Teachers | None = None,
    ) -> None:
        if num_stages > 1 and transport is None:
            raise ValueError("a multi-stage executor needs a transport")
        self.module = module
        self.stage = stage
        self.blocks = blocks
        self.seed = seed
        self.transport = transport
        self.telemetry = telemetry
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        # (global subnet, chunk) -> per block (input, output); the last block's output is replaced by
        # the weighted loss on the last stage. Kept for backward.
        self._stash = {} if stash is None else stash
        self.defer_weight_grads = defer_weight_grads and not self.is_first
        self.ties = ties
        self.chunk_offset = chunk_offset
        self.replicas = replicas
        self._teachers = Teachers() if teachers is None else teachers
        self._teacher_parameter: bool | None = None
        #: Per backward, seconds from having its output gradients to sending its input gradients.
        self.seconds_to_send: list[float] = []

    def run(self, actions: Sequence[Action], window: Window, update: Callable[[int], None],
            first_forward: Callable[[int], None] | None = None) -> None:
        """Run ``actions`` in order; ``update(k)`` steps the optimizer for window subnet ``k``;
        ``first_forward(k)`` (if given) runs before subnet ``k``'s first forward on this stage."""
        for action in actions:
            if self.telemetry is not None:
                self.telemetry.start_action()
                start = time.perf_counter()
            if action.kind == FORWARD:
                if first_forward is not None and action.chunk == 0:
                    first_forward(action.subnet)
                self._forward(window, action.subnet, action.chunk)
            elif action.kind == BACKWARD:
                self._backward(window, action.subnet, action.chunk)
            elif action.kind == UPDATE:
                update(action.subnet)
                index = window.first_index + action.subnet
                self._teachers.drop_from(index, index)
            else:  # pragma: no cover - the scheduler only emits the three kinds
                raise ValueError(f"unknown action {action}")
            if self.telemetry is not None:
                self.telemetry.action(str(action), action.kind, action.subnet, start, time.perf_counter())

    def forward_only(self, batch: Batch, architecture: Architecture) -> BlockValue:
        """This stage's part of an evaluation forward; the output on the last stage, else ``None``."""
        passing: dict[int, Tensor] = {}
        if self.is_first:
            x = self.module.pipeline_input(batch)
        else:
            assert self.transport is not None
            x = self.transport.recv_value(self.stage - 1)
            if self.ties is not None:
                x, passing = self.ties.take_values(0, x)
        for _, x in self._run_blocks(x, architecture, EVALUATION_INDEX, 0):
            pass
        if self.is_last:
            return x
        assert self.transport is not None
        self.transport.send_value(self.stage + 1, x if self.ties is None else self.ties.with_values(0, x, passing))
        return None

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

    def _loss(self, window: Window, y: Any, piece: Any, index: int, c: int, subnet: int, chunk: int,
              keyed: contextlib.AbstractContextManager[None]) -> Any:
        """``compute_loss`` of the last block's output ``y``, inside ``keyed``; in-place distillation's teacher kept
        and passed on (outside it: that may wait for a message)."""
        # On several processes compute_loss runs on the last stage only: what it changes outside the supernet
        watch = outside_state(self.module) if self.transport is not None or self.replicas is not None else None
        before = watch.snapshot() if watch is not None else None
        if not self._wants_teacher():
            with keyed:
                loss = self.module.compute_loss(y, piece)
        else:
            k = index - window.first_index  # in-place distillation: the step's first subnet teaches the others
            if len(window.steps[k]) > 1:
                self._teachers.relay(index, c, len(window.pieces[k]), self.chunk_offset)
                if subnet == 0:
                    self._teachers.keep(index, chunk, y)
            teacher = self._teachers.teacher(index, chunk) if subnet else None
            with keyed:
                loss = self.module.compute_loss(y, piece, teacher=teacher)  # type: ignore[call-arg]
        if watch is not None and before is not None:
            watch.refuse_changes(before)
        return loss

    def _forward(self, window: Window, k: int, c: int) -> None:
        index = window.first_index + k
        if self.replicas is None:
            self._forward_chunk(window, k, c)
            return
        with self.replicas.forward(index, self.chunk_offset + c):
            self._forward_chunk(window, k, c)

    def _forward_chunk(self, window: Window, k: int, c: int) -> None:
        m = self.chunk_offset + c
        architecture, piece, weight, subnet, chunk = window.micro_batch(k, m)
        index = window.first_index + k
        ties = self.ties if c == 0 else None  # tied values travel with a subnet's first activation
        passing: dict[int, Tensor] = {}
        if self.is_first:
            x = self.module.pipeline_input(piece)
        else:
            assert self.transport is not None
            x = self.transport.recv_activation(index, c)
            if ties is not None:
                x, passing = ties.take_values(k, x)
        saved = list(self._run_blocks(x, architecture, index, m))
        y = saved[-1][1]
        if self.is_last:
            token = _LOSS_CONTEXT.set((index, window.records))
            try:
                # Keyed like a block: randomness in the loss (torch's, Python's, NumPy's) depends on the subnet and
                # micro-batch only, not on what this process ran before (other stages' blocks, other replicas').
                loss = self._loss(window, y, piece, index, c, subnet, chunk, keyed_rng(device_of(x), self.seed,
                                                                                      index, LOSS_KEY, m))
            finally:
                _LOSS_CONTEXT.reset(token)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise TypeError(f"compute_loss must return a scalar tensor, got {describe(loss)}.")
            if len(window.pieces[k]) > 1:
                loss = loss * weight
            window.chunk_losses[k][m] = loss.detach()
            saved[-1] = (saved[-1][0], loss)
        else:
            assert self.transport is not None
            self.transport.send_activation(index, c, y if ties is None else ties.with_values(k, y, passing))
        self._stash[(index, c)] = saved

    def _backward(self, window: Window, k: int, c: int) -> None:
        """Backward block by block, last to first: each block's outputs get the gradients its
        successor's input leaves collected (see :mod:`.boundary`). With :attr:`defer_weight_grads`,
        the weight gradients are computed after the input gradients are sent."""
        if self.replicas is None:
            self._backward_chunk(window, k, c)
            return
        with self.replicas.backward(window.first_index + k, self.chunk_offset + c):
            self._backward_chunk(window, k, c)

    def _backward_chunk(self, window: Window, k: int, c: int) -> None:
        index = window.first_index + k
        saved = self._stash.pop((index, c))
        deferred = DeferredWeights(self._collect) if self.defer_weight_grads else None
        blocks = reversed(self.blocks)
        inputs, outputs = saved.pop()
        block = next(blocks)
        architecture = window.micro_batch(k, self.chunk_offset + c)[0]
        passing: list[Any] = []
        contributions: list[Tensor | None] = []  # to parameters tied to an earlier stage's (see ties.py)
        if self.is_last:
            start = time.perf_counter()
            # Lightning's precision plugins scale the loss here
            self._capturing(k, block, contributions, lambda: self.module.manual_backward(outputs))
            grads = leaf_grads(inputs)
        else:
            assert self.transport is not None
            received = self.transport.recv_gradient(index, c)
            if self.ties is not None:
                received, passing = self.ties.take_grads(k, received, self._collect)
            start = time.perf_counter()
            grads = self._capturing(k, block, contributions, lambda: self._block_backward(
                outputs, received, inputs, architecture, block, deferred))
        for block in blocks:
            inputs, outputs = saved.pop()
            grads = self._capturing(k, block, contributions, lambda: self._block_backward(
                outputs, grads, inputs, architecture, block, deferred))
        if not self.is_first:
            assert self.transport is not None
            self.seconds_to_send.append(time.perf_counter() - start)
            if self.ties is not None:
                grads = self.ties.with_grads(k, grads, passing, contributions)
            self.transport.send_gradient(index, c, grads)
        if deferred is not None:
            deferred.run()

    def _wants_teacher(self) -> bool:
        if self._teacher_parameter is None:
            self._teacher_parameter = wants_teacher(self.module)
        return self._teacher_parameter

    def _capturing(self, k: int, block: int, contributions: list[Tensor | None], backward: Callable[[], _T]) -> _T:
        """``backward()`` of ``block``; with a copy of a parameter tied to an earlier stage's in it, that copy's
        ``.grad`` is the block's contribution alone, taken into ``contributions`` (the copy keeps no gradient)."""
        tensors = self.ties.captured(k, block) if self.ties is not None else []
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
        if self.replicas is not None:
            self.replicas.collect()

    def _block_backward(self, outputs: Any, grads: Sequence[Tensor | None], inputs: Any,
                        architecture: Architecture, block: int,
                        deferred: DeferredWeights | None) -> tuple[Tensor | None, ...]:
        if deferred is None:
            backward_through(outputs, grads)
            return leaf_grads(inputs)
        supernet = self.module.supernet
        params: list[Tensor] = [p for r in sorted(supernet.resources((block,), architecture))
                                for p in supernet.resource_state(r).params]
        if self.ties is not None:  # a tied copy's contribution is sent before the weight passes: one pass for it
            params = self.ties.ties.owned(self.stage, params)
        return deferred.backward(outputs, grads, inputs, params)
