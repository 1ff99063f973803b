"""Weights tied across pipeline stages, exact (a GPT's token embedding and output projection).

Blocks on different stages may share a parameter (``head.weight = embedding.weight``). Each of those stages
holds a copy; the *owner*, the stage of the first block holding it (:func:`.placement.first_blocks`), keeps its
optimizer state and steps it, and its copy is the one checkpoints and weight syncs take. The others are
*holders*. Shared buffers never span stages (:func:`.partition.shared_buffer_cuts`).

On one device a subnet's blocks run backward last to first, each block boundary a gradient boundary
(:mod:`.boundary`), so the tensor's ``.grad`` is set by the last block using it and each earlier block's
contribution is added on top (``.grad = g_late``, then ``.grad += g_early``), chunk after chunk. Across stages,
per subnet ``j`` using the tensor's resource (by the window's scheduling resources,
:func:`.actions.with_ties`)::

    forward   owner ──(j, 0)'s activation + the value──► ... ──► each holder copies it in before F(j, 0)
    backward  holder: each of its blocks' contribution, as that block's backward leaves it in .grad (last block
              first) ──(j, c)'s input gradients + the contributions──► ... ──► owner: onto .grad, in that order,
              before its own blocks' backward of (j, c)

The owner's update then steps the tensor with bitwise the one-device gradient; clipping counts its norm once,
there. The values ride the messages the schedule sends anyway (one extra tensor in the first activation of a
subnet reading the weight downstream, one per block and chunk in its gradients), so the schedule needs no new
message: :func:`.actions.with_ties` makes the owner a CSP user of the tied resource for every subnet using it
anywhere, and the value a holder receives with ``F(j, 0)`` is then the one after the last earlier update.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.placement.moves import first_blocks, owner_of
from lightning_naspipe.space.supernet import BlockValue, Resource, Supernet

__all__ = ["Shared", "StageTies", "TieRoutes", "ties_of"]


@dataclass(frozen=True)
class Shared:
    """One parameter that blocks on several stages hold.

    Attributes:
        tensor: the parameter (this process's copy).
        resource: the resource it belongs to (one across the stages).
        owner: the stage that steps it: its first block's.
        blocks: per stage holding it (the owner included), the blocks there holding it, last first.
    """

    tensor: Tensor
    resource: Resource
    owner: int
    blocks: dict[int, tuple[int, ...]]


class StageTies:
    """The parameters that blocks on different stages share under one split (see the module docstring).

    Args:
        supernet: the search space.
        stage_blocks: the blocks of each stage.

    Raises:
        NASPipeConfigError: a buffer is shared by blocks on two stages.
    """

    def __init__(self, supernet: Supernet, stage_blocks: Sequence[range]) -> None:
        self.stage_blocks = list(stage_blocks)
        blocks = list(supernet.blocks)
        self._first = first_blocks(blocks)
        holding: dict[int, tuple[Tensor, list[int]]] = {}
        for i, block in enumerate(blocks):
            for param in block.parameters():
                holding.setdefault(id(param), (param, []))[1].append(i)
            for buffer in block.buffers():
                if owner_of(stage_blocks, self._first[id(buffer)]) != owner_of(stage_blocks, i):
                    raise NASPipeConfigError(
                        f"Blocks {self._first[id(buffer)]} and {i} share a buffer but run on different stages "
                        f"({[len(r) for r in stage_blocks]} blocks per stage); a buffer that every forward may change "
                        "(BatchNorm's running statistics) must live on one stage. Split elsewhere.")
        resource_of = {id(p): key for key, state in supernet.stage_resources(range(len(blocks))).items()
                       for p in state.params}
        #: The shared parameters, in the order of their first block (the same in every stage process).
        self.shared: list[Shared] = []
        for tensor, where in holding.values():
            per_stage: dict[int, list[int]] = {}
            for b in reversed(where):
                per_stage.setdefault(owner_of(stage_blocks, b), []).append(b)
            if len(per_stage) > 1:
                self.shared.append(Shared(tensor, resource_of[id(tensor)], owner_of(stage_blocks, where[0]),
                                          {s: tuple(bs) for s, bs in sorted(per_stage.items())}))
        #: Each tied resource's owner stages (:func:`.actions.with_ties`).
        self.homes: dict[Resource, frozenset[int]] = {}
        for shared in self.shared:
            self.homes[shared.resource] = self.homes.get(shared.resource, frozenset()) | {shared.owner}
        self.in_block: dict[int, list[int]] = {}  # block -> the shared parameters it holds, by index
        for n, shared in enumerate(self.shared):
            for bs in shared.blocks.values():
                for b in bs:
                    self.in_block.setdefault(b, []).append(n)

    def owned(self, stage: int, params: Iterable[Tensor]) -> list[Tensor]:
        """Those of ``params`` that ``stage`` steps: its own blocks' that no earlier stage's block holds."""
        own = self.stage_blocks[stage]
        return [p for p in params if self._first[id(p)] in own]

    def routes(self, stage: int, resources: Sequence[Sequence[frozenset[Resource]]] | None) -> TieRoutes:
        """How ``stage`` moves the shared parameters in a window with these scheduling ``resources`` (per subnet and
        stage), or, with ``None``, in an evaluation forward (every value to every holder)."""
        return TieRoutes(self, stage, resources)


class TieRoutes:
    """What one stage sends, takes and relays of the shared parameters in one window (see :class:`StageTies`).

    A subnet reads a shared parameter on a stage that holds it when the subnet's resources there include the
    parameter's resource. Messages carry the values as extra tensors after the activation (chunk 0) and after
    the input gradients; both ends know how many from the window's plan.
    """

    def __init__(self, ties: StageTies, stage: int, resources: Sequence[Sequence[frozenset[Resource]]] | None) -> None:
        self.ties, self.stage, self.resources = ties, stage, resources
        self.last = len(ties.stage_blocks) - 1
        self.value_slots = cache(self._value_slots)
        self.grad_slots = cache(self._grad_slots)

    def _reads(self, k: int, stage: int, n: int) -> bool:
        shared = self.ties.shared[n]
        return stage in shared.blocks and (self.resources is None or shared.resource in self.resources[k][stage])

    def _value_slots(self, k: int, stage: int) -> tuple[int, ...]:
        """The shared parameters whose values subnet ``k``'s first activation carries from ``stage`` to the next."""
        return tuple(n for n, shared in enumerate(self.ties.shared) if shared.owner <= stage
                     and any(self._reads(k, h, n) for h in shared.blocks if h > stage))

    def _grad_slots(self, k: int, stage: int) -> tuple[int, ...]:
        """The contributions (by shared parameter) subnet ``k``'s input gradients carry from ``stage`` to the one
        before: per holder from the last stage down to ``stage``, per block last first."""
        shared = self.ties.shared
        return tuple(n for h in range(self.last, stage - 1, -1) for b in reversed(self.ties.stage_blocks[h])
                     for n in self.ties.in_block.get(b, ()) if shared[n].owner < stage and self._reads(k, h, n))

    def take_values(self, k: int, message: BlockValue) -> tuple[BlockValue, dict[int, Tensor]]:
        """Subnet ``k``'s first activation without the values it carries; the values this stage reads are copied in
        (nothing reads this stage's copy meanwhile: CSP), the others kept to pass on."""
        slots = self.value_slots(k, self.stage - 1)
        if not slots:
            return message, {}
        passing = dict(zip(slots, message[1:]))
        for n, value in passing.items():
            if self._reads(k, self.stage, n):
                # Through .data: an equal value may meet a graph saved by a forward run ahead (lookahead).
                self.ties.shared[n].tensor.data.copy_(value)
        return message[0], passing

    def with_values(self, k: int, activation: BlockValue, passing: dict[int, Tensor]) -> BlockValue:
        """The message of subnet ``k``'s first activation to the next stage: the values later stages read with it."""
        slots = self.value_slots(k, self.stage)
        if not slots:
            return activation
        return (activation, *(passing[n] if n in passing else self.ties.shared[n].tensor.detach() for n in slots))

    def take_grads(self, k: int, message: tuple[Tensor | None, ...],
                   accumulated: Callable[[], None] = lambda: None) -> tuple[tuple[Tensor | None, ...], list[Any]]:
        """Subnet ``k``'s input gradients from the next stage without the contributions they carry; those to the
        parameters this stage owns go onto their ``.grad`` one by one, in order (before this stage's blocks'
        backward), ``accumulated()`` called after each; the others are kept to pass on."""
        slots = self.grad_slots(k, self.stage + 1)
        if not slots:
            return message, []
        grads, values = message[:len(message) - len(slots)], message[len(message) - len(slots):]
        passing = []
        with torch.no_grad():
            for n, value in zip(slots, values):
                if self.ties.shared[n].owner != self.stage:
                    passing.append(value)
                elif value is not None:
                    p = self.ties.shared[n].tensor
                    if p.grad is None:  # as autograd keeps a first gradient: in the parameter's layout
                        p.grad = torch.empty_like(p).copy_(value)
                    else:
                        p.grad.add_(value)
                    accumulated()
        return grads, passing

    def captured(self, k: int, block: int) -> list[Tensor]:
        """The copies whose contribution ``block``'s backward of subnet ``k`` leaves, to be taken and sent on."""
        return [self.ties.shared[n].tensor for n in self.ties.in_block.get(block, ())
                if self.ties.shared[n].owner < self.stage and self._reads(k, self.stage, n)]

    def with_grads(self, k: int, grads: tuple[Tensor | None, ...], passing: list[Any],
                   contributions: list[Tensor | None]) -> tuple[Tensor | None, ...]:
        """The message of subnet ``k``'s input gradients to the stage before: the contributions passed on, then this
        stage's (its blocks last first)."""
        if not self.grad_slots(k, self.stage):
            return grads
        return (*grads, *passing, *contributions)


_CACHE: weakref.WeakKeyDictionary[Supernet, tuple[tuple[range, ...], StageTies | None]] = weakref.WeakKeyDictionary()


def ties_of(supernet: Supernet, stage_blocks: Sequence[range]) -> StageTies | None:
    """The ties of ``supernet`` under this split; ``None`` when no parameter spans stages (cached per split)."""
    key = tuple(stage_blocks)
    cached = _CACHE.get(supernet)
    if cached is None or cached[0] != key:
        ties = StageTies(supernet, key)
        cached = _CACHE[supernet] = (key, ties if ties.shared else None)
    return cached[1]
