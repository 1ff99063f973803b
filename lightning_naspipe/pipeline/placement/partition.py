"""Splitting the supernet's blocks into contiguous pipeline stages.

Blocks that share a parameter (a GPT's tied token embedding and output projection) may go to different
stages, each holding a copy (:mod:`.ties`); blocks that share a buffer (a BatchNorm reused in two places, whose
running statistics every forward changes) stay on one stage (:func:`shared_buffer_cuts`).

The strategy's default split balances *measured* forward + backward time per block
(:func:`.block_timing.timed_block_weights`), timed on the mixin's ``supernet_example_input`` or else
on the first training batch. Until that timing, and as the fallback, the split balances the
*expected parameter count per subnet*: a fixed block counts its parameters, a choice block the
mean over its candidates (what one subnet runs there), and every block counts at least 1 so
parameter-free blocks still spread. An explicit ``balance`` overrides both.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.choice import candidates_of
from lightning_naspipe.space.supernet import Supernet


def block_weights(supernet: Supernet) -> list[float]:
    """Each block's expected parameter count for one subnet (at least 1)."""
    weights = []
    for block in supernet.blocks:
        candidates = candidates_of(block)
        weights.append(max(sum(_numel(c) for c in candidates) / len(candidates), 1.0))
    return weights


def balanced_split(weights: Sequence[float], stages: int, forbidden: frozenset[int] = frozenset()) -> list[int]:
    """Blocks per stage for a contiguous split minimising the heaviest stage (exact, by DP).

    Args:
        weights: each block's cost.
        stages: how many stages.
        forbidden: cut positions not allowed (``j``: between blocks ``j - 1`` and ``j``).

    Raises:
        NASPipeConfigError: no split into ``stages`` avoids the forbidden cuts.
    """
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
                if j in forbidden or best[s - 1][j] == inf:
                    continue
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    if best[stages][count] == inf:
        raise NASPipeConfigError(
            f"No split of the supernet's {count} blocks into {stages} stages keeps shared buffers on one stage "
            f"(cuts not allowed before blocks {sorted(forbidden)}, between blocks sharing a buffer, e.g. a BatchNorm "
            "reused in both); use fewer stages or give each block its own module."
        )
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
        weights: each block's cost, e.g. :func:`.block_timing.timed_block_weights`; default
            :func:`block_weights`.

    Raises:
        NASPipeConfigError: more stages than blocks, or a ``balance`` that does not cover the blocks.
    """
    count = len(supernet)
    if stages > count:
        raise NASPipeConfigError(
            f"{stages} pipeline stages but the supernet has only {count} blocks; every stage needs at least one "
            f"block. Use at most {count} stages (devices x nodes, or num_stages) or split the supernet into more "
            "blocks."
        )
    forbidden = shared_buffer_cuts(supernet)
    if balance is None:
        sizes = balanced_split(weights if weights is not None else block_weights(supernet), stages, forbidden)
    else:
        sizes = list(balance)
        if len(sizes) != stages or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != count:
            raise NASPipeConfigError(
                f"balance={list(balance)} must give a positive block count for each of the {stages} stages, "
                f"summing to the supernet's {count} blocks (e.g. {balanced_split(block_weights(supernet), stages)})."
            )
        cuts = {sum(sizes[:s]) for s in range(1, stages)}
        if cuts & forbidden:
            raise NASPipeConfigError(
                f"balance={sizes} cuts before block(s) {sorted(cuts & forbidden)}, between blocks that share a buffer "
                "(e.g. a BatchNorm reused in both: its running statistics must live on one stage); move the cut or "
                "leave balance unset."
            )
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def shared_buffer_cuts(supernet: Supernet) -> frozenset[int]:
    """Cut positions that would put a buffer used by several blocks (a BatchNorm reused in two) on two stages.

    Every forward in training mode may change such a buffer (running statistics), chunk by chunk in the
    one-device order, so it cannot be kept on two stages as a tied parameter is (see :mod:`.ties`).
    """
    spans: dict[int, tuple[int, int]] = {}
    for i, block in enumerate(supernet.blocks):
        for buffer in block.buffers():
            spans[id(buffer)] = (spans.get(id(buffer), (i, i))[0], i)
    return frozenset(j for first, last in spans.values() for j in range(first + 1, last + 1))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
