"""One stage's worker: runs its forward, backward and update actions in schedule order.

The same executor runs the single-stage (sequential) path and every stage of the pipeline;
only the :class:`Transport` between stages differs, so the two paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
import time
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_naspipe.sampling import keyed_rng
from lightning_naspipe.schedule import BACKWARD, FORWARD, UPDATE, Action, Schedule
from lightning_naspipe.supernet import Architecture, Supernet
from lightning_naspipe.telemetry import StageTelemetry


# Randomness key of evaluation forwards: apart from every training subnet's (indices are >= 0).
EVALUATION_INDEX = -1


class Transport(Protocol):
    """Moves activations to the next stage and gradients to the previous one (see ``transport.py``)."""

    def begin_window(self, schedule: Schedule) -> None: ...

    def end_window(self) -> None: ...

    def share(self, value: Any) -> Any: ...

    def share_losses(self, losses: Sequence[Tensor | None]) -> list[Tensor]: ...

    def send_activation(self, subnet: int, chunk: int, value: Any) -> None: ...

    def recv_activation(self, subnet: int, chunk: int) -> Any: ...

    def send_gradient(self, subnet: int, chunk: int, value: Any) -> None: ...

    def recv_gradient(self, subnet: int, chunk: int) -> Any: ...

    def send_value(self, stage: int, value: Any) -> None: ...

    def recv_value(self, stage: int) -> Any: ...


class StageModule(Protocol):
    """What the executor needs from the user's module (the mixin provides it)."""

    supernet: Supernet

    def pipeline_input(self, batch: Any) -> Any: ...

    def compute_loss(self, output: Any, batch: Any) -> Tensor: ...

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None: ...


@dataclass
class Window:
    """The subnets of one Lightning batch and their micro-batches.

    Attributes:
        first_index: global index (training step) of the window's first subnet.
        architectures: one architecture per subnet.
        pieces: per subnet, its ``(micro-batch, weight)`` pairs.
        losses: per subnet, its loss (the weighted sum of its micro-batch losses); filled on
            the last stage only.
    """

    first_index: int
    architectures: list[Architecture]
    pieces: list[list[tuple[Any, float]]]
    losses: list[Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.losses = [None] * len(self.architectures)


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
        # (subnet, chunk) -> (stage inputs, stage outputs or the weighted loss), kept for backward.
        self._stash: dict[tuple[int, int], tuple[Any, Any]] = {}

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
            else:  # pragma: no cover - the scheduler only emits the three kinds
                raise ValueError(f"unknown action {action}")
            if self.telemetry is not None:
                self.telemetry.action(str(action), action.kind, action.subnet, start, time.perf_counter())

    def forward_only(self, batch: Any, architecture: Architecture) -> Any:
        """This stage's part of an evaluation forward; the output on the last stage, else ``None``."""
        if self.is_first:
            x = self.module.pipeline_input(batch)
        else:
            assert self.transport is not None
            x = self.transport.recv_value(self.stage - 1)
        x = self._run_blocks(x, architecture, EVALUATION_INDEX, 0)
        if self.is_last:
            return x
        assert self.transport is not None
        self.transport.send_value(self.stage + 1, x)
        return None

    def _run_blocks(self, x: Any, architecture: Architecture, index: int, chunk: int) -> Any:
        device = _device_of(x)
        for block in self.blocks:
            with keyed_rng(device, self.seed, index, block, chunk):
                x = self.module.supernet.block_op(block, architecture)(x)
        return x

    def _forward(self, window: Window, k: int, c: int) -> None:
        piece, weight = window.pieces[k][c]
        if self.is_first:
            inputs = self.module.pipeline_input(piece)
        else:
            assert self.transport is not None
            inputs = self.transport.recv_activation(k, c)
        x = self._run_blocks(inputs, window.architectures[k], window.first_index + k, c)
        if self.is_last:
            loss = self.module.compute_loss(x, piece)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise TypeError(f"compute_loss must return a scalar tensor, got {_describe(loss)}.")
            if len(window.pieces[k]) > 1:
                loss = loss * weight
            total = window.losses[k]
            window.losses[k] = loss.detach() if total is None else total + loss.detach()
            self._stash[(k, c)] = (inputs, loss)
        else:
            assert self.transport is not None
            self.transport.send_activation(k, c, x)
            self._stash[(k, c)] = (inputs, x)

    def _backward(self, window: Window, k: int, c: int) -> None:
        inputs, outputs = self._stash.pop((k, c))
        if self.is_last:
            self.module.manual_backward(outputs)
        else:
            assert self.transport is not None
            grads = self.transport.recv_gradient(k, c)
            pairs = [(o, g) for o, g in zip(tensors_of(outputs), tensors_of(grads)) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.is_first:
            assert self.transport is not None
            self.transport.send_gradient(k, c, _input_grads(inputs))


def tensors_of(value: Any) -> list[Tensor]:
    """The tensors of a block's input or output: the tensor itself, or a tuple's or list's tensors."""
    if isinstance(value, Tensor):
        return [value]
    return [v for v in value if isinstance(v, Tensor)] if isinstance(value, (tuple, list)) else []


def _input_grads(inputs: Any) -> Any:
    """The gradient for each tensor the previous stage sent (zeros where none flowed)."""
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors_of(inputs)]
    return grads[0] if isinstance(inputs, Tensor) else tuple(grads)


def _device_of(value: Any) -> torch.device:
    for tensor in tensors_of(value):
        return tensor.device
    return torch.device("cpu")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
