"""Validation, test and predict on data-parallel replicas: each replica evaluates its share of the batches, exactly.

Lightning's evaluation loop hands every rank every batch, one at a time, and the user's ``validation_step`` (or
``test_step``, ``predict_step``) runs unchanged on every rank. Unsharded, each replica also runs every batch's forward
through its own pipeline (:meth:`.Engine.evaluate`), so replicas add nothing to evaluation speed. Sharded, the first
``subnet_output`` call of a group of ``D`` consecutive batches (``D`` replicas) runs one forward per replica: replica
``r`` takes batch ``b + r`` of the group starting at batch ``b``, under ``eval_architecture(b + r)``, and the replicas
exchange their outputs (:meth:`.Engine.evaluate_shard`), so every rank holds every output of the group; the group's
later steps get theirs from that exchange, without a forward::

    batch      b        b+1      b+2      b+3      (D = 2)
    replica 0  F(b)     -        F(b+2)   -        then every rank holds both outputs of the group
    replica 1  F(b+1)   -        F(b+3)   -

The replicas hold the same weights and run the same forward, so each output is bit for bit the unsharded one (which
is the plain Trainer's), and every step's user code, loss and logged values are what they were.

The future batches of a group come from :class:`LookaheadLoader`, which wraps each evaluation dataloader: it yields
the user's batches one by one, as they are, and lets the group read the next ones early from the same iterator,
never past the batches Lightning itself reads in that pass (``limit_val_batches``, ``num_sanity_val_steps``, the
loader's end). A replica processes a future batch as Lightning does before the step (the precision plugin's
``convert_input``, then ``batch_to_device``).

**The rule.** A ``subnet_output(batch, architecture)`` call starts a group, or takes its output from one, only when
it cannot change a result; every other call runs unsharded, as before. All of these hold alike on every rank:

* the strategy has ``D > 1`` replicas, and the call is made from a ``validation_step``, ``test_step`` or
  ``predict_step`` that takes ``batch_idx`` (not the ``dataloader_iter`` flavour), with that step's ``batch`` object
  as Lightning handed it (not a copy or a part of it, and not changed in place);
* the supernet is in eval mode throughout (a module in training mode, e.g. BatchNorm updating running statistics,
  would see batches in another order on each replica);
* neither the module nor its datamodule overrides a batch-transfer hook (a replica runs them on its future batch
  ahead of Lightning, which would run them again);
* at least two batches are left in the pass (a last group has fewer than ``D``: its batches go to the first
  replicas; a single batch runs unsharded).

A group predicts the architectures of its later steps: ``eval_architecture(b + r, dataloader_idx)`` when the call
passed ``eval_architecture(b, dataloader_idx)`` (the default steps, or a step calling
``self.subnet_output(batch, self.eval_architecture(batch_idx))``; keep it a pure function of its index), else the
same architecture (a fixed list of subnets evaluated on every batch, each call its own group). A later step takes a
group's output only for its own batch and the architecture the group ran for it, as often as it calls so (a metric
may call again); a call the group did not predict starts a group of its own there, or runs unsharded. Outputs are
kept until their step is past. A dataset that draws from torch's global generator while a step draws from it too
would see the draws in another order (a group reads ahead): keep evaluation data deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_naspipe.space.supernet import BlockValue

if TYPE_CHECKING:
    from lightning_naspipe.pipeline.runtime.engine import Engine, EngineModule

__all__ = ["EvalShards", "LookaheadLoader", "step_position"]

#: Batches a loader keeps after handing them out: Lightning fetches one ahead of the step, a group starts at its step.
_KEEP = 4


class LookaheadLoader:
    """An evaluation dataloader that yields the user's batches as they are and lets :meth:`batches` read ahead.

    Args:
        dataloader: the user's (already Lightning-processed) evaluation dataloader.
        started: called with this loader each time Lightning starts iterating it (a pass over its batches begins).
    """

    _OWN = frozenset({"dataloader", "_started", "_source", "_ahead", "_recent", "_yielded", "_ended"})

    def __init__(self, dataloader: Any, started: Callable[[LookaheadLoader], None]) -> None:
        self.dataloader = dataloader
        self._started = started
        self._source: Iterator[Any] | None = None  # this pass's iterator of the user's loader
        self._ahead: deque[Any] = deque()  # read for a group, not yet handed out
        self._recent: dict[int, Any] = {}  # the last batches handed out, by index in the pass
        self._yielded = 0  # batches handed out in this pass
        self._ended = False

    def __getattr__(self, name: str) -> Any:
        # Lightning and users read attributes such as ``sampler``, ``batch_size`` or ``dataset``.
        if name in LookaheadLoader._OWN:
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets some on the loader (``worker_init_fn`` under ``seed_everything(workers=True)``).
        if name in LookaheadLoader._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataloader, name, value)

    def __len__(self) -> int:
        return len(self.dataloader)  # a TypeError for a loader without length, as Lightning expects

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.dataloader)
        self._source, self._ahead, self._recent, self._yielded, self._ended = source, deque(), {}, 0, False
        self._started(self)
        return self._batches(source)

    @property
    def handed_out(self) -> int:
        """Batches handed out in the running pass."""
        return self._yielded

    def _batches(self, source: Iterator[Any]) -> Iterator[Any]:
        while self._source is source:
            if not self._ahead and not self._read():
                return
            batch = self._ahead.popleft()
            self._recent[self._yielded] = batch
            self._recent.pop(self._yielded - _KEEP, None)
            self._yielded += 1
            yield batch

    def _read(self) -> bool:
        if self._ended or self._source is None:
            return False
        try:
            self._ahead.append(next(self._source))
        except StopIteration:
            self._ended = True
            return False
        return True

    def batches(self, start: int, count: int) -> list[Any]:
        """Batches ``start, start + 1, ...`` of the running pass, ``count`` at most (fewer at its end): those handed
        out already (the last few are kept), then read ahead from the same iterator, to be handed out in turn."""
        found = []
        for index in range(start, start + count):
            if index < self._yielded:
                if index not in self._recent:
                    break
                found.append(self._recent[index])
                continue
            while len(self._ahead) <= index - self._yielded:
                if not self._read():
                    return found
            found.append(self._ahead[index - self._yielded])
        return found


def step_position(args: tuple[Any, ...], takes_batch_idx: bool) -> tuple[Any, int, int] | None:
    """``(batch, batch_idx, dataloader_idx)`` of an evaluation step called with ``args``, as Lightning builds them
    (``batch``, ``batch_idx`` when the step takes it, ``dataloader_idx`` with several loaders); ``None`` when the step
    does not take ``batch_idx`` (or is the ``dataloader_iter`` flavour)."""
    if not takes_batch_idx or len(args) < 2 or not isinstance(args[1], int):
        return None
    dataloader_idx = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    return args[0], args[1], dataloader_idx


class EvalShards:
    """The strategy's side of sharded evaluation: the running pass's loader, the step in progress, and the outputs
    the replicas exchanged for the group's later steps (see the module doc for when it shards).

    Args:
        prepare: what Lightning does to a batch of dataloader ``dataloader_idx`` before the step,
            ``prepare(batch, dataloader_idx)``.
        limit: the batches Lightning reads in this pass from dataloader ``dataloader_idx`` (may be ``inf``).
        device: this rank's compute device (where the exchanged outputs land).
        hooks_overridden: whether the module or datamodule overrides a batch-transfer hook (then nothing shards).
    """

    def __init__(self, prepare: Callable[[Any, int], Any], limit: Callable[[int], int | float],
                 device: Callable[[], torch.device], hooks_overridden: Callable[[], bool]) -> None:
        self._prepare = prepare
        self._limit = limit
        self._device = device
        self._hooks_overridden = hooks_overridden
        self.loader: LookaheadLoader | None = None
        self._step: tuple[Any, int, int] | None = None
        # (loader, batch index, architecture) -> output, of the running groups' batches.
        self._cache: dict[tuple[int, int, tuple[tuple[str, int], ...]], BlockValue] = {}
        #: Groups run sharded, and ``subnet_output`` calls answered from one (sharded) or run unsharded, this process.
        self.groups = 0
        self.sharded_calls = 0
        self.unsharded_calls = 0

    def wrap(self, dataloader: Any) -> LookaheadLoader:
        """``dataloader`` as the strategy hands it to Lightning's evaluation loop."""
        return LookaheadLoader(dataloader, self._started)

    def _started(self, loader: LookaheadLoader) -> None:
        self.loader = loader
        self._cache.clear()

    @contextmanager
    def step(self, position: tuple[Any, int, int] | None) -> Iterator[None]:
        """An evaluation step at ``position`` (:func:`step_position`) runs inside."""
        self._step = position
        try:
            yield
        finally:
            self._step = None

    def output(self, module: EngineModule, engine: Engine, batch: Any,
               architecture: dict[str, int]) -> tuple[BlockValue] | None:
        """``(output,)`` of ``subnet_output(batch, architecture)`` from a group of the replicas (collective at a
        group's first batch), or ``None``: run it unsharded."""
        step, loader, replicas = self._step, self.loader, engine.replicas
        if step is None or batch is not step[0] or loader is None or replicas is None or replicas.replicas < 2:
            return self._unsharded()
        _, batch_idx, dataloader_idx = step
        supernet = module.supernet
        architecture = supernet.validate(architecture)
        cached = self._cache.get((id(loader), batch_idx, _key(architecture)))
        if cached is not None:  # (a step may call again for the same subnet, e.g. for a metric)
            self.sharded_calls += 1
            return (cached,)
        if (loader.handed_out not in (batch_idx + 1, batch_idx + 2)  # this pass's step (Lightning reads one ahead)
                or any(m.training for m in supernet.modules()) or self._hooks_overridden()):
            return self._unsharded()
        left = self._limit(dataloader_idx) - batch_idx
        raw = loader.batches(batch_idx, int(min(replicas.replicas, left)))
        if len(raw) < 2:
            return self._unsharded()
        count, replica = len(raw), replicas.replica
        # The group's later steps will call with eval_architecture of their index if this one did, else with this
        # same architecture (a fixed list of subnets evaluated on every batch); a step that does not, runs unsharded.
        eval_architecture: Callable[[int, int], dict[str, int]] = cast(Any, module).eval_architecture
        follows = architecture == supernet.validate(eval_architecture(batch_idx, dataloader_idx))
        architectures = [architecture] + [supernet.validate(eval_architecture(batch_idx + k, dataloader_idx))
                                          if follows else architecture for k in range(1, count)]
        mine = (batch if replica == 0 else self._prepare(raw[replica], dataloader_idx)) if replica < count else None
        outputs = engine.evaluate_shard(module, count, mine, architectures[replica] if replica < count else None,
                                        self._device())
        self._cache = {key: value for key, value in self._cache.items()
                       if key[0] == id(loader) and key[1] >= batch_idx}  # the steps before are done
        self._cache.update({(id(loader), batch_idx + k, _key(architectures[k])): outputs[k] for k in range(count)})
        self.groups += 1
        self.sharded_calls += 1
        return (outputs[0],)

    def _unsharded(self) -> tuple[BlockValue] | None:
        self.unsharded_calls += 1
        return None


def _key(architecture: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(architecture.items()))
