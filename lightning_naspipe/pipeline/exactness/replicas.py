"""Data-parallel replicas of a stage that sum like one device: gradients and BatchNorm statistics in
micro-batch order.

On one device a subnet's gradient is accumulated micro-batch by micro-batch: ``((g0 + g1) + g2) + g3``.
Floating-point addition is not associative, so an all-reduce (a ring or tree of partial sums) would
change the bits. Here the replicas of a stage each train a contiguous share of the micro-batches
(:meth:`.Layout.chunk_share`) and, in the subnet's update, chain their sums in that order:

* replica 0 accumulates its micro-batches as one device does (its ``.grad`` *is* the prefix sum) and
  sends it to replica 1;
* every later replica keeps each of its micro-batches' gradients apart, adds them one by one to the
  prefix it receives, and sends the result on. "One by one" is per accumulation, not per micro-batch: one
  device adds each backward call's gradient onto ``.grad`` in turn (a stage runs one call per block, so a
  weight two blocks read, like a tied embedding and head, gets two addends per micro-batch, plus one per
  contribution a later stage sends for a tied weight), and ``(prefix + a) + b`` is not ``prefix + (a + b)``.
  The engine calls :meth:`ReplicaUpdates.collect` after each such accumulation;
* the last replica's sum is the one-device gradient, bit for bit; it goes back to every replica, so all
  of them step the same parameters with the same gradient. Each element's additions are the same in
  every piece of :mod:`.streamed`, so cutting the gradients into pieces changes no bit.

BatchNorm in training computes its output from the batch's statistics, so only its running statistics
depend on the order. Replica 0 updates them as one device does; a later replica keeps each BatchNorm
input of its micro-batches and, once it has the running statistics the replica before it ended with,
replays the update with the forward's own call (``F.batch_norm``, so the same kernel), micro-batch by micro-batch.

Cost per subnet update and stage: the gradients take the chain in pieces (:mod:`.streamed`): while a
replica adds its addends to one piece the next replica adds to the piece before, and the last replica's
sums stream back the same way, so an update costs about one pass of its gradient bytes plus ``2D - 3``
pieces' hops; in the planner's model that stays within 2x of a ring all-reduce of the same bytes at any
``D``, where ``2 (D - 1)`` whole-gradient messages grew with ``D``. BatchNorm buffers, small, then take the
chain as one message down and back (only where the supernet has BatchNorm layers). A later replica holds
one gradient copy per micro-batch it trains until the update, and a reference to each of its BatchNorm
inputs (which autograd keeps for the backward anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_naspipe.compat.torch import tensor_version
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.exactness.streamed import streamed_sum
from lightning_naspipe.space.elastic import ElasticBatchNorm1d, ElasticBatchNorm2d
from lightning_naspipe.transport.failures import FailureBoard

__all__ = ["ReplicaGroup", "ReplicaUpdates", "ordered_sum", "replay_statistics", "tracks_statistics"]

# Elastic ones update the running statistics of the leading channels their input has (see space/elastic.py).
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, ElasticBatchNorm1d, ElasticBatchNorm2d)


class ReplicaGroup(Protocol):
    """The replicas of this process's stage, as the engine needs them (see :mod:`.transport.replica_links`)."""

    @property
    def replica(self) -> int:
        """This process's replica, 0-based."""
        ...

    @property
    def replicas(self) -> int:
        """How many replicas the stage has."""
        ...

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting for another replica so far."""
        ...

    @property
    def failures(self) -> FailureBoard | None:
        """Where a failing process posts its error for the others to name; ``None`` where no one reads it."""
        ...

    def send_next(self, value: Any) -> None:
        """Send ``value`` to the next replica (not waiting for it to be received)."""
        ...

    def recv_previous(self) -> Any:
        """The next value the previous replica sent."""
        ...

    def send_previous(self, value: Any) -> None:
        """Send ``value`` to the previous replica (not waiting for it to be received)."""
        ...

    def recv_next(self) -> Any:
        """The next value the next replica sent."""
        ...

    def from_last(self, value: Any) -> Any:
        """The last replica's ``value`` (pass ``None`` elsewhere) on every replica."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every replica's ``value``, in replica order (collective over the stage's replicas)."""
        ...

    def flush(self) -> None:
        """Wait until every message this replica sent has been delivered (at a window's end)."""
        ...

    def close(self) -> None:
        """Release the links; unusable afterwards."""
        ...


def ordered_sum(parts: Sequence[Tensor | None]) -> Tensor | None:
    """``parts`` summed left to right as autograd accumulates ``.grad`` (``None``: nothing flowed)."""
    total: Tensor | None = None
    for part in parts:
        if part is not None:
            total = part if total is None else total + part
    return total


class ReplicaUpdates:
    """One replica's side of the exact gradient and BatchNorm reduction of its stage (see the module doc).

    Args:
        group: the replicas of this stage.
        supernet: the module whose BatchNorm layers are watched.
        owner: the module holding ``supernet`` (the LightningModule), whose other buffers must stay constant in a
            training forward too (``compute_loss`` runs inside one on the last stage).
    """

    def __init__(self, group: ReplicaGroup, supernet: nn.Module, owner: nn.Module | None = None) -> None:
        self.group = group
        #: Per subnet: the parameters its update steps on this stage (set by the engine for each window).
        self.params: dict[int, Sequence[Tensor]] = {}
        # Per (subnet, chunk) of a later replica: per parameter, each accumulation's addend in order; and
        # the micro-batch's BatchNorm inputs.
        self._grads: dict[tuple[int, int], list[list[Tensor]]] = {}
        self._collecting: tuple[int, int] | None = None
        self._inputs: dict[tuple[int, int], list[tuple[nn.Module, Tensor]]] = {}
        # The watched BatchNorm layers, and per subnet the positions of those its forwards updated on this replica.
        self._layers = [m for m in supernet.modules() if isinstance(m, _BATCH_NORMS)]
        self._position = {id(m): k for k, m in enumerate(self._layers)}
        self._touched: dict[int, set[int]] = {}
        # On a later replica, per (subnet, layer position): the layer's statistics before the subnet's forwards,
        # which updated them as one device would not; the update replays them from there.
        self._before: dict[tuple[int, int], list[Tensor]] = {}
        self._current: tuple[int, int] | None = None
        # Every other buffer must stay as it is: its order across replicas is not reproduced.
        self._others = [(f"The supernet's buffer {f'{name}.{n}'.lstrip('.')!r}", b)
                        for name, m in supernet.named_modules() if not isinstance(m, _BATCH_NORMS)
                        for n, b in m.named_buffers(recurse=False)]
        inside = {id(b) for b in supernet.buffers()}
        self._others += [(f"The buffer {name!r} of {type(owner).__name__}, outside the supernet,", b)
                         for name, b in (owner.named_buffers() if owner is not None else ()) if id(b) not in inside]
        self._hooks = [m.register_forward_pre_hook(_Hook(self)) for m in self._layers]

    def close(self) -> None:
        """Remove the BatchNorm hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @contextlib.contextmanager
    def forward(self, index: int, chunk: int) -> Iterator[None]:
        """Around subnet ``index``'s training forward of micro-batch ``chunk`` on this stage."""
        versions = [tensor_version(b) for _, b in self._others]
        self._current = (index, chunk)
        try:
            yield
        finally:
            self._current = None
        for (what, buffer), version in zip(self._others, versions):
            if tensor_version(buffer) != version:
                raise NASPipeConfigError(
                    f"{what} changed in a training forward. With several replicas per stage, NASPipe reproduces the "
                    "one-device order of the supernet's BatchNorm running statistics only; keep other buffers "
                    "constant in training, or use one replica (num_stages = processes)."
                )

    @contextlib.contextmanager
    def backward(self, index: int, chunk: int) -> Iterator[None]:
        """Around micro-batch ``chunk``'s backward of subnet ``index``: on a later replica its gradients
        of the update's :attr:`params` are kept apart; replica 0 accumulates them in ``.grad``, as one
        device does."""
        if self.group.replica == 0:
            yield
            return
        for p in self.params[index]:
            p.grad = None
        self._grads[(index, chunk)] = [[] for _ in self.params[index]]
        self._collecting = (index, chunk)
        try:
            yield
        finally:
            self.collect()
            self._collecting = None

    def collect(self) -> None:
        """Inside a later replica's :meth:`backward`: take what the last accumulation left in ``.grad`` (one
        backward call, or one contribution added by hand) as an addend of its own, and clear ``.grad``."""
        if self._collecting is None:
            return
        index, _ = self._collecting
        for parts, p in zip(self._grads[self._collecting], self.params[index]):
            if p.grad is not None:
                parts.append(p.grad)
                p.grad = None

    def reduce(self, index: int, chunks: range, params: Sequence[Tensor]) -> None:
        """Before subnet ``index``'s update: give ``params`` the one-device gradient and this stage's BatchNorm
        layers the one-device running statistics, on every replica. ``chunks``: this replica's micro-batches.

        The subnets of a training step may differ across its replicas' shares, and so the BatchNorm layers each
        replica's forwards updated: a message names the layers whose statistics it carries, every one that this
        replica or one before it updated."""
        group, touched = self.group, self._touched.pop(index, set())
        self.params.pop(index, None)
        _refuse_sparse([p.grad for p in params] if group.replica == 0 else
                       [t for c in chunks for parts in self._grads.get((index, c), []) for t in parts])
        if group.replica == 0:  # its .grad is the prefix: the sum of its micro-batches, as on one device
            addends = [[] if p.grad is None else [p.grad] for p in params]
        else:
            own = [self._grads.pop((index, chunk), [[] for _ in params]) for chunk in chunks]
            addends = [[part for mine in own for part in mine[i]] for i in range(len(params))]
        grads = streamed_sum(group, addends, params)
        if self._layers:  # the same on every replica: the statistics take the chain after the gradients
            self._reduce_statistics(index, chunks, touched)
        for p, grad in zip(params, grads):
            p.grad = None if grad is None else grad.to(p.device)

    def _reduce_statistics(self, index: int, chunks: range, touched: set[int]) -> None:
        """The BatchNorm running statistics in one message down the chain (each replica replaying its
        micro-batches' updates) and the last replica's back (a few small buffers: no pieces)."""
        group = self.group
        if group.replica > 0:
            received = group.recv_previous()
            before = received[-1].tolist()
            buffers = _unpacked(received[:-1], self._statistics(before))
            for k in touched:
                _load(self._statistics([k]), self._before.pop((index, k)))
            _load(self._statistics(before), buffers)
            for chunk in chunks:
                for layer, batch in self._inputs.pop((index, chunk), []):
                    replay_statistics(layer, batch)
            touched.update(before)
        layers = sorted(touched)
        # copied out as it is sent: the values of now
        message = (*_packed(self._statistics(layers)), torch.tensor(layers, dtype=torch.long))
        if group.replica < group.replicas - 1:
            group.send_next(message)
            message = group.from_last(None)
            layers = message[-1].tolist()
            buffers = _unpacked(message[:-1], self._statistics(layers))
            _load(self._statistics(layers), buffers)
        else:
            group.from_last(message)

    def _statistics(self, layers: Sequence[int]) -> list[Tensor]:
        """The buffers of the watched BatchNorm layers at positions ``layers``, in that order."""
        return [b for k in layers for b in self._layers[k].buffers(recurse=False)]

    def drop_from(self, index: int) -> None:
        """Forget what forwards of subnets ``index`` and later kept (a lookahead that did not come)."""
        for kept in (self._grads, self._inputs, self._before):
            for key in [key for key in kept if key[0] >= index]:
                del kept[key]
        for by_subnet in (self._touched, self.params):
            for subnet in [subnet for subnet in by_subnet if subnet >= index]:
                del by_subnet[subnet]

    def batch_norm_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of the watched BatchNorm layers."""
        current = self._current
        if current is None or not module.training or not tracks_statistics(module):
            return
        touched, position = self._touched.setdefault(current[0], set()), self._position[id(module)]
        if self.group.replica > 0 and position not in touched:
            self._before[(current[0], position)] = [b.detach().clone() for b in module.buffers(recurse=False)]
        touched.add(position)
        if self.group.replica > 0:
            self._inputs.setdefault(current, []).append((module, args[0].detach()))


class _Hook:
    """The BatchNorm pre-hook; a copy of the module (``copy.deepcopy``, pickling) gets one that does nothing,
    rather than this process's links to the other replicas."""

    def __init__(self, updates: ReplicaUpdates | None) -> None:
        self.updates = updates

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.updates is not None:
            self.updates.batch_norm_input(module, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return _Hook(None)

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (_Hook, (None,))


def _refuse_sparse(grads: Sequence[Tensor | None]) -> None:
    if any(g is not None and g.is_sparse for g in grads):
        raise NASPipeConfigError(
            "A sparse gradient (e.g. nn.Embedding(sparse=True)) cannot be summed across data-parallel replicas: "
            "NASPipe reduces gradients as dense buffers in micro-batch order. Use sparse=False, or one replica "
            "(num_stages = processes)."
        )


def _packed(statistics: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """BatchNorm statistics as one message of a few tensors: one flat buffer per dtype (about 10 µs per tensor
    packed or unpacked, and a stage may hold dozens)."""
    flat: dict[torch.dtype, list[Tensor]] = {dtype: [] for dtype in _dtypes(statistics)}
    for value in statistics:
        flat[value.dtype].append(value.detach().reshape(-1))
    return tuple(torch.cat(parts) for parts in flat.values())


def _unpacked(message: Sequence[Tensor], statistics: Sequence[Tensor]) -> list[Tensor]:
    """What :func:`_packed` sent: views of its flat buffers shaped as ``statistics``."""
    flat = dict(zip(_dtypes(statistics), message))
    offsets = dict.fromkeys(flat, 0)
    values = []
    for template in statistics:
        start = offsets[template.dtype]
        offsets[template.dtype] = start + template.numel()
        values.append(flat[template.dtype][start:start + template.numel()].view(template.shape))
    return values


def _dtypes(templates: Sequence[Tensor]) -> list[torch.dtype]:
    return list(dict.fromkeys(t.dtype for t in templates))


def _load(statistics: Sequence[Tensor], values: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for buffer, value in zip(statistics, values):
            buffer.copy_(value)


def tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm layer keeping running statistics, which its training forwards update and a
    later replica replays (whatever its mode now: the caller checks that where it matters)."""
    return isinstance(module, _BATCH_NORMS) and bool(getattr(module, "track_running_stats", False))


def replay_statistics(layer: Any, batch: Tensor) -> None:
    """The running-statistics update a training forward of ``layer`` on ``batch`` makes: the forward's own call
    (``F.batch_norm`` with the factor ``_BatchNorm.forward`` computes, the layer's weight and bias), so that every
    device picks the kernel the forward picked (cuDNN updates the statistics itself); its output is dropped. An
    elastic layer's on the leading channels ``batch`` has (views, updated in place as its forward updates them)."""
    factor = 0.0 if layer.momentum is None else layer.momentum
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        if layer.momentum is None:
            factor = 1.0 / float(layer.num_batches_tracked)
    tensors: list[Tensor | None] = [layer.running_mean, layer.running_var, layer.weight, layer.bias]
    if isinstance(layer, (ElasticBatchNorm1d, ElasticBatchNorm2d)):
        tensors = [None if t is None else t[:batch.shape[1]] for t in tensors]
    running_mean, running_var, weight, bias = tensors
    with torch.no_grad():
        F.batch_norm(batch, running_mean, running_var, weight, bias, True, factor, layer.eps)
