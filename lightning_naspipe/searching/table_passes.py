"""How a latency table times its blocks in place: in passes over the blocks, each a share of the repeats.

:meth:`.LatencyTable.measure` times every block's candidates, and each label inside a block around its reference
choice, where the block runs it (:func:`reaching_context`: the subnet nearest the reference that reads the label). It
does so in :data:`PASSES` passes over the blocks, each taking a share of the repeats, so that a slow spell of the
machine (seconds, on a shared VM) lands in one pass of a block, which the median over every pass's runs outvotes,
instead of in all of one block's runs: two tables of one space once predicted 27% apart.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_naspipe.searching.timing import Clock, interleaved_times
from lightning_naspipe.space.choice import ChoiceBlock, Elastic, When
from lightning_naspipe.space.freezing import freeze_block
from lightning_naspipe.space.supernet import Supernet

__all__ = ["PASSES", "Runs", "inner_labels", "input_of", "label_contexts", "reaching_context", "reads",
           "reference_choices", "timed_pass"]

#: Passes over the blocks that share a table's repeats.
PASSES = 3


def inner_labels(block: nn.Module) -> tuple[str, ...]:
    """The labels inside ``block``, in first-seen order: those of its choice blocks (its own too), of its elastic
    modules' dimensions and of its ``When`` modules (a DARTS edge's input choice)."""
    found: dict[str, None] = {}
    for module in block.modules():
        if isinstance(module, (ChoiceBlock, When)) and module.label is not None:
            found.setdefault(module.label)
        elif isinstance(module, Elastic):
            found.update((dim.label, None) for dim in module.dims.values() if dim.label is not None)
    return tuple(found)


def reference_choices(net: Supernet) -> dict[str, int]:
    """The choice each label's deltas are taken around: the middle one for an elastic width several blocks read (a
    shared width, as AutoFormer's embedding), the first for every other label.

    A cost that multiplies a layer's own choice by the shared width (an MLP's ratio times the embedding width) is
    then off by the width's distance from the middle, both ways, not from the smallest, which under-predicted every
    wide subnet (AutoFormer-style spaces by ~25%). An op choice several cells share (NB201's edges) is not a width:
    centred, every cell's baseline ran its middle op and the deltas of a subnet dropping ops everywhere missed the
    node sums that vanish with them (its smallest subnets predicted 30-50% slow; 6-28% from its first choice).
    """
    widths = {dim.label for module in net.modules() if isinstance(module, Elastic) for dim in module.dims.values()}
    readers = collections.Counter(label for block in net.blocks for label in inner_labels(block) if label in widths)
    return {label: (count - 1) // 2 if readers[label] > 1 else 0 for label, count in net.labels.items()}


def reads(net: Supernet, index: int, architecture: Mapping[str, int]) -> set[str]:
    """The labels block ``index`` reads in subnet ``architecture``."""
    return {label for scope in net.block_scopes(index).active(architecture) for label, _, _ in scope.choices}


def reaching_context(net: Supernet, index: int, label: str, reference: Mapping[str, int],
                     inside: Sequence[str], limit: int = 4096) -> dict[str, int] | None:
    """The subnet nearest ``reference`` (fewest and lowest changes of block ``index``'s other labels) in which the
    block reads ``label``: ``reference`` itself unless ``label`` sits in a deeper layer of an ``ElasticDepth``, a
    candidate not taken, or a cell edge not chosen; ``None`` when no subnet within ``limit`` tries reads it."""
    others = [name for name in inside if name != label]
    frontier: list[dict[str, int]] = [dict(reference)]
    visited = {tuple(sorted(reference.items()))}
    while frontier and len(visited) <= limit:
        following: list[dict[str, int]] = []
        for arch in frontier:
            if label in reads(net, index, arch):
                return arch
            for name in others:
                for k in range(net.labels[name]):
                    if arch[name] == reference[name] != k:
                        step = {**arch, name: k}
                        key = tuple(sorted(step.items()))
                        if key not in visited:
                            visited.add(key)
                            following.append(step)
        frontier = following
    return None


def input_of(net: Supernet, index: int, example_input: Any, architecture: Mapping[str, int]) -> Any:
    """What block ``index`` receives in subnet ``architecture``."""
    x = example_input
    for b in range(index):
        x = net.run_block(b, x, architecture)
    return x


def label_contexts(net: Supernet, reference: Mapping[str, int],
                   labels: Sequence[str | None]) -> dict[tuple[int, str], dict[str, int] | None]:
    """Per ``(block, label inside it)`` of the blocks without a label of their own: the subnet it is timed in
    (:func:`reaching_context`; ``None``: no subnet runs it there)."""
    found: dict[tuple[int, str], dict[str, int] | None] = {}
    for b, label in enumerate(labels):
        inside = inner_labels(net.blocks[b]) if label is None else ()
        found.update({(b, inner): reaching_context(net, b, inner, reference, inside) for inner in inside})
    return found


#: Per measurement, ``(block, None, candidate)`` or ``(block, inner label, choice)``, its timed runs in ms.
Runs = dict[tuple[int, str | None, int], list[float]]


def timed_pass(net: Supernet, example_input: Any, reference: Mapping[str, int], labels: Sequence[str | None],
               contexts: dict[tuple[int, str], dict[str, int] | None], runs: Runs, repeats: int, warmup: int,
               device: torch.device, clock: Clock) -> None:
    """One pass of :meth:`.LatencyTable.measure` over the blocks: ``repeats`` runs of each candidate (key ``(block,
    None, k)``) and of each choice of each label inside a block (``(block, label, k)``) appended to ``runs``, a
    block's measurements interleaved; ``contexts``: where each inner label is timed (:func:`label_contexts`)."""
    seen: set[str] = set()  # the labels earlier blocks read: a choice of theirs changes what block b receives
    x: Any = example_input
    for b, label in enumerate(labels):
        count = net.labels[label] if label is not None else 1
        timed: list[tuple[tuple[int, str | None, int], tuple[nn.Module, Any]]] = [
            ((b, None, k), (freeze_block(net, b, {**reference, **({label: k} if label else {})}), x))
            for k in range(count)]
        inside = inner_labels(net.blocks[b])
        for inner in inside if label is None else ():
            context = contexts[(b, inner)]
            if context is None:  # no architecture runs it in this block: it costs nothing here
                continue

            def run(arch: Mapping[str, int]) -> tuple[nn.Module, Any]:
                changed = {name for name, k in arch.items() if k != reference[name]}
                return freeze_block(net, b, arch), input_of(net, b, example_input, arch) if changed & seen else x

            # Each label's choices timed together, their runs interleaved, its reference among them: a slow spell of
            # the machine or one slow baseline would otherwise shift the deltas, and errors add up.
            timed += [((b, inner, k), run({**context, inner: k})) for k in range(net.labels[inner])]
        for key, times in zip([key for key, _ in timed],
                              interleaved_times([job for _, job in timed], repeats, warmup, device, clock)):
            runs[key] += times
        seen.update(inside)
        x = net.run_block(b, x, reference)
