"""Splitting the supernet's blocks into contiguous pipeline stages.

With an example input (the mixin's ``supernet_example_input``) the split balances *measured*
forward + backward time per block (:func:`timed_block_weights`). Without one it balances the
*expected parameter count per subnet*: a fixed block counts its parameters, a choice block the
mean over its candidates (what one subnet runs there), and every block counts at least 1 so
parameter-free blocks still spread. Parameters are a poor proxy for convolutions at high
resolution and for attention, so give an example input or pass ``balance`` explicitly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.supernet import ChoiceBlock, Supernet


def block_weights(supernet: Supernet) -> list[float]:
    """Each block's expected parameter count for one subnet (at least 1)."""
    weights = []
    for block in supernet.blocks:
        if isinstance(block, ChoiceBlock):
            weight = sum(_numel(c) for c in block.candidates) / len(block)
        else:
            weight = float(_numel(block))
        weights.append(max(weight, 1.0))
    return weights


def timed_block_weights(supernet: Supernet, example_input: Any, per_block: int = 4, repeats: int = 3) -> list[float]:
    """Each block's measured forward + backward seconds for one subnet batch.

    A choice block counts the mean over its first ``per_block`` candidates; each op is timed on a
    copy, the fastest of ``repeats`` runs after a warm-up (other jobs on a machine only ever add
    time), inside a forked RNG, so the supernet's weights, buffers and the global RNG are untouched.

    Args:
        supernet: the search space.
        example_input: what the first block receives for one subnet batch.
        per_block: candidates timed per choice block.
        repeats: timed runs per op.

    Raises:
        NASPipeConfigError: a block cannot run on the example input (or on the previous block's output).
    """
    weights, x = [], example_input
    with torch.random.fork_rng(devices=[]):
        for index, block in enumerate(supernet.blocks):
            ops = list(block.candidates)[:per_block] if isinstance(block, ChoiceBlock) else [block]
            try:
                timed = [_time_op(copy.deepcopy(op), x, repeats) for op in ops]
            except Exception as error:
                raise NASPipeConfigError(
                    f"Timing block {index} of the supernet on the example input failed ({type(error).__name__}: "
                    f"{error}). supernet_example_input must be what the first block receives for one subnet "
                    "batch (pipeline_input(batch)); or pass NASPipeStrategy(balance=[...])."
                ) from error
            weights.append(sum(seconds for seconds, _ in timed) / len(ops))
            x = timed[-1][1]  # the next block's input
    return weights


def agreed_timed_weights(supernet: Supernet, example_input: Any, timing_rank: bool,
                         broadcast: Callable[[Any], Any]) -> list[float]:
    """:func:`timed_block_weights` measured on one rank and ``broadcast`` to all, so every stage
    process splits alike; a timing error is raised on every rank, not only the timing one."""
    timed: tuple[list[float] | None, str] = (None, "")
    if timing_rank:
        try:
            timed = (timed_block_weights(supernet, example_input), "")
        except NASPipeConfigError as error:
            timed = (None, str(error))
    weights, message = broadcast(timed)
    if message:
        raise NASPipeConfigError(message)
    assert weights is not None
    return list(weights)


def _time_op(op: nn.Module, x: Any, repeats: int) -> tuple[float, Any]:
    inputs = _detached(x)
    output = None
    elapsed = float("inf")
    for run in range(repeats + 1):  # run 0 warms up (allocator, lazy kernels)
        start = time.perf_counter()
        output = op(inputs)
        outputs = [t for t in _leaves(output) if t.requires_grad]
        if outputs:
            torch.autograd.backward([t.float().sum() for t in outputs])
        if run:
            elapsed = min(elapsed, time.perf_counter() - start)
        for tensor in _leaves(inputs):
            tensor.grad = None
    return elapsed, _detached(output)


def _leaves(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    return [v for v in value if isinstance(v, Tensor)] if isinstance(value, (tuple, list)) else []


def _detached(value: Any) -> Any:
    def leaf(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(t.is_floating_point())

    if isinstance(value, Tensor):
        return leaf(value)
    if isinstance(value, (tuple, list)):
        return type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    return value


def balanced_split(weights: Sequence[float], stages: int) -> list[int]:
    """Blocks per stage for a contiguous split minimising the heaviest stage (exact, by DP)."""
    count = len(weights)
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[s][i]: the smallest possible heaviest stage when the first i blocks form s stages.
    best = [[inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, count - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    sizes, i = [], count
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_ranges(supernet: Supernet, stages: int, balance: Sequence[int] | None = None,
                 weights: Sequence[float] | None = None) -> list[range]:
    """The block indices of each stage.

    Args:
        supernet: the search space.
        stages: the number of pipeline stages.
        balance: blocks per stage (e.g. ``[3, 2]``); ``None`` balances ``weights``.
        weights: each block's cost, e.g. :func:`timed_block_weights`; default :func:`block_weights`.

    Raises:
        NASPipeConfigError: more stages than blocks, or a ``balance`` that does not cover the blocks.
    """
    count = len(supernet)
    if stages > count:
        raise NASPipeConfigError(
            f"{stages} pipeline stages but the supernet has only {count} blocks; every stage needs at least one "
            f"block. Use at most {count} stages (devices x nodes, or num_stages) or split the supernet into more blocks."
        )
    if balance is None:
        sizes = balanced_split(weights if weights is not None else block_weights(supernet), stages)
    else:
        sizes = list(balance)
        if len(sizes) != stages or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != count:
            raise NASPipeConfigError(
                f"balance={list(balance)} must give a positive block count for each of the {stages} stages, "
                f"summing to the supernet's {count} blocks (e.g. {balanced_split(block_weights(supernet), stages)})."
            )
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_no_shared_parameters(supernet: Supernet, ranges: Sequence[range]) -> None:
    """Refuse a parameter or buffer used by blocks on two stages (e.g. tied weights)."""
    owner: dict[int, int] = {}
    for stage, blocks in enumerate(ranges):
        for index in blocks:
            block = supernet.blocks[index]
            for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
                first = owner.setdefault(id(tensor), stage)
                if first != stage:
                    raise NASPipeConfigError(
                        f"Block {index} ({name}) shares a parameter or buffer with a block on stage {first}, but runs on "
                        f"stage {stage}; tied weights must live on one stage. Pass balance=... so that the blocks "
                        "sharing it are on the same stage, or untie them."
                    )


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
