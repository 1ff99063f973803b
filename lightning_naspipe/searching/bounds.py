"""The smallest and largest parameter and FLOP counts a space's architectures can have, from the space alone.

A search refuses a range no architecture can meet (:func:`refuse_impossible`) before it draws or evaluates anything,
naming the space's bound, rather than evaluating thousands of draws that all miss it.

Each block is counted on its own: every combination of the labels inside it (others at candidate 0) is frozen and
the block's parameters (and, given an input, FLOPs) counted. The space's bounds are the sums of the blocks' minima
and maxima. They are *sound*: no architecture lies outside them, so a refusal never turns away a feasible ask.
They are *exact* when no label is read by two blocks and no parameter is shared between blocks; otherwise a label's
choices must agree across its blocks (which can only raise the true minimum or lower the true maximum) and tied
weights are counted once in a subnet (the lower bound then subtracts each tied weight once per extra block holding
it, the upper bound counts it per block).
FLOPs are bounded only where every block's output has the same shapes under all its choices, so that what each
block receives does not depend on the architecture; else they are left unbounded (nothing refused).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.constraints import Constraints
from lightning_naspipe.searching.latency import batch_size_of
from lightning_naspipe.searching.table_passes import inner_labels
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.freezing import freeze_block
from lightning_naspipe.space.supernet import Supernet, describe

__all__ = ["SpaceBounds", "refuse_impossible", "space_bounds"]

#: Combinations of one block's labels counted at most; a block with more leaves its quantity unbounded.
MAX_COMBINATIONS = 1024


@dataclass(frozen=True)
class SpaceBounds:
    """The fewest and most parameters (and FLOPs per sample) of any architecture of a space.

    Attributes:
        min_params: no architecture has fewer parameters.
        max_params: no architecture has more.
        min_flops: no architecture has fewer FLOPs per sample (``None``: not bounded).
        max_flops: no architecture has more (``None``: not bounded).
        exact: whether the bounds are met by an architecture (:attr:`smallest`, :attr:`largest`).
        smallest: an architecture with the fewest parameters, when exact.
        largest: one with the most, when exact.
    """

    min_params: Optional[int]
    max_params: Optional[int]
    min_flops: Optional[int] = None
    max_flops: Optional[int] = None
    exact: bool = False
    smallest: Optional[Architecture] = None
    largest: Optional[Architecture] = None


def space_bounds(supernet: Supernet, example_input: Any = None) -> SpaceBounds:
    """Count the bounds of ``supernet``'s architectures (see the module); FLOPs only with ``example_input`` (what
    the first block receives for one batch: the counts are per sample)."""
    reference = {label: 0 for label in supernet.labels}
    blocks = [inner_labels(block) for block in supernet.blocks]
    combos = [math.prod(supernet.labels[label] for label in labels) for labels in blocks]
    if max(combos, default=1) > MAX_COMBINATIONS:
        return SpaceBounds(None, None)
    tied = _tied_overlap(supernet)
    low, high = -tied, 0  # a tied weight is counted once per block that holds it, but once in a subnet
    flop_low: Optional[int] = 0 if example_input is not None else None
    flop_high: Optional[int] = flop_low
    smallest: dict[str, int] = {}
    largest: dict[str, int] = {}
    x = example_input
    for b, labels in enumerate(blocks):
        rows: list[tuple[int, int, str, dict[str, int]]] = []  # params, FLOPs, output shapes, choice
        following = x  # what the next block receives: this block's output at the reference (the first choice)
        for values in itertools.product(*(range(supernet.labels[label]) for label in labels)):
            choice = dict(zip(labels, values))
            block = freeze_block(supernet, b, {**reference, **choice}).eval()
            params = sum(p.numel() for p in block.parameters())
            flops, shapes = 0, ""
            if flop_low is not None:
                try:
                    flops, shapes, out = _flops(block, x)
                except (RuntimeError, ValueError, TypeError, IndexError):  # it cannot run on the reference input
                    flop_low = flop_high = None
                else:
                    following = out if not rows else following
            rows.append((params, flops, shapes, choice))
        low += min(r[0] for r in rows)
        high += max(r[0] for r in rows)
        smallest.update(min(rows, key=lambda r: r[0])[3])
        largest.update(max(rows, key=lambda r: r[0])[3])
        if flop_low is not None and flop_high is not None:
            if len({r[2] for r in rows}) > 1:  # what later blocks receive depends on this block's choices
                flop_low = flop_high = None
            else:
                flop_low += min(r[1] for r in rows)
                flop_high += max(r[1] for r in rows)
                x = following
    exact = not tied and sum(len(labels) for labels in blocks) == len({label for ls in blocks for label in ls})
    samples = batch_size_of(example_input)
    return SpaceBounds(max(low, 0), high, None if flop_low is None else flop_low // samples,
                       None if flop_high is None else -(-flop_high // samples), exact,
                       {**reference, **smallest} if exact else None, {**reference, **largest} if exact else None)


def _tied_overlap(supernet: Supernet) -> int:
    """How many parameters the blocks' counts can hold twice: each supernet parameter held by ``k > 1`` blocks (tied
    weights), ``k - 1`` times its size (a subnet's copy of it is at most that size)."""
    holders: dict[int, tuple[int, int]] = {}  # id -> (blocks holding it, size)
    for block in supernet.blocks:
        for p in block.parameters():
            held = holders.get(id(p), (0, p.numel()))
            holders[id(p)] = (held[0] + 1, held[1])
    return sum((count - 1) * size for count, size in holders.values())


def _flops(block: torch.nn.Module, x: Any) -> tuple[int, str, Any]:
    """``block``'s FLOPs on ``x``, its output's shapes and its output."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = block(x)
    return int(counter.get_total_flops()), describe(out), out


def refuse_impossible(limits: Constraints, supernet: Supernet, example_input: Any = None) -> Optional[SpaceBounds]:
    """Raise when a parameter or FLOP range of ``limits`` lies outside the space's bounds; the bounds counted
    (``None`` when nothing is bounded by size).

    Raises:
        NASPipeConfigError: no architecture can meet a range; the message names the space's bound.
    """
    flops_asked = limits.min_flops is not None or limits.max_flops is not None
    if not limits.bounds_size:
        return None
    bounds = space_bounds(supernet, example_input if flops_asked else None)
    word = "has" if bounds.exact else "has at least"
    for name, low, high, unit in (("params", bounds.min_params, bounds.max_params, "parameters"),
                                  ("flops", bounds.min_flops, bounds.max_flops, "FLOPs per sample")):
        ask_max, ask_min = getattr(limits, f"max_{name}"), getattr(limits, f"min_{name}")
        if ask_max is not None and low is not None and ask_max < low:
            which = f" ({bounds.smallest})" if bounds.exact and name == "params" else ""
            raise NASPipeConfigError(
                f"Constraints(max_{name}={ask_max:,}): no architecture of this space has at most {ask_max:,} {unit}: "
                f"the smallest {word} {low:,}{which}. Raise max_{name} to at least {low:,}, or search a smaller "
                "space.")
        if ask_min is not None and high is not None and ask_min > high:
            which = f" ({bounds.largest})" if bounds.exact and name == "params" else ""
            word = "has" if bounds.exact else "has at most"
            raise NASPipeConfigError(
                f"Constraints(min_{name}={ask_min:,}): no architecture of this space has at least {ask_min:,} "
                f"{unit}: the largest {word} {high:,}{which}. Lower min_{name} to at most {high:,}, or search a "
                "larger space.")
    return bounds
