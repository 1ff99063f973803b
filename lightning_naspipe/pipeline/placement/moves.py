"""Changing which stage owns which blocks while training: the weights, buffers and optimizer state of
every block that changes stage go from its old owner to its new one (collective, at a window boundary).

The default split uses it once: the strategy starts on a split by parameter counts, times the blocks
on the first real batch and moves to the split that balances the measured time. Results do not depend on
it: a moved block continues from exactly the tensors its old owner held.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_naspipe.transport.distributed import broadcast_tensors_, hand_over_optimizer_state
from lightning_naspipe.space.supernet import Supernet


def owner_of(ranges: Sequence[range], block: int) -> int:
    """The stage whose range holds ``block``."""
    return next(stage for stage, blocks in enumerate(ranges) if block in blocks)


def first_blocks(blocks: Sequence[nn.Module]) -> dict[int, int]:
    """``id(tensor) -> the first block holding it``, for every parameter and buffer of ``blocks``.

    A tensor's authoritative copy is on that block's stage, its *owner*: the one copy of a weight tied across
    stages that is stepped, checkpointed and handed on when blocks move (see :mod:`.ties`).
    """
    first: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for tensor in (*block.parameters(), *block.buffers()):
            first.setdefault(id(tensor), i)
    return first


def place_module(module: nn.Module, supernet: Supernet, own: Sequence[int] | None, device: torch.device) -> None:
    """Put the stage's ``own`` blocks (all when ``None``) and everything of ``module`` outside the supernet
    on ``device``; the other blocks stay where the user built them. (The caller sets what a LightningModule's
    ``device`` reports: the pipeline reaches no Lightning internals.)"""
    for i, block in enumerate(supernet.blocks):
        if own is None or i in own:
            block.to(device)
    for child in module.children():
        if child is not supernet:
            child.to(device)
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        tensor.data = tensor.data.to(device)


def move_blocks(supernet: Supernet, optimizer: Optimizer | None, old: Sequence[range], new: Sequence[range],
                stage: int, device: torch.device, on_device: bool, ranks: Sequence[int] | None = None,
                world_size: int | None = None) -> list[int]:
    """Hand every block whose stage differs between ``old`` and ``new`` to its new owner (collective).

    Args:
        supernet: the search space (the same on every rank).
        optimizer: the optimizer over the supernet's parameters, if any.
        old: the block ranges per stage now.
        new: the block ranges per stage to move to.
        stage: this process's stage.
        device: this stage's compute device.
        on_device: whether this stage keeps its blocks on ``device`` (``False`` with offload, which
            keeps them in host memory).
        ranks: the global rank that sends each stage's blocks (default: rank = stage); with data-parallel
            replicas, replica 0 of each stage: every replica of the new stage receives.
        world_size: all processes (default: one per stage).

    Returns:
        The moved blocks.
    """
    moved = [i for i in range(len(supernet)) if owner_of(old, i) != owner_of(new, i)]
    if not moved:
        return moved
    blocks = list(supernet.blocks)
    first = first_blocks(blocks)
    # Each tensor from its owner: a weight tied to an earlier block is current there, not on this block's stage.
    tensors = {id(t): t for i in moved for t in (*blocks[i].parameters(), *blocks[i].buffers())}
    senders = list(ranks) if ranks is not None else list(range(len(new)))
    by_sender: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors.values():
        by_sender.setdefault(senders[owner_of(old, first[id(tensor)])], []).append(tensor)
    for sender, sent in by_sender.items():  # packed, one collective per sender (same order on every rank)
        broadcast_tensors_(sent, sender, device)
    for i in moved:
        if owner_of(old, i) == stage:
            blocks[i].to("cpu")  # no longer this stage's: free the device
    if on_device:  # after the above: a weight tied to a block that left is still this stage's
        for i in new[stage]:
            blocks[i].to(device)
    if optimizer is not None:
        owners = {pid: (owner_of(old, first[pid]), owner_of(new, first[pid])) for pid in tensors}
        moving = {pid: (was, now) for pid, (was, now) in owners.items() if was != now}
        hand_over_optimizer_state(optimizer, moving, stage, world_size or len(new))
    return moved


def rebalanced(ranges: Sequence[range], busy: Sequence[float], weights: Sequence[float],
               forbidden: frozenset[int] = frozenset(), margin: float = 0.02,
               excess: float = 0.25) -> list[range] | None:
    """One block moved off the busiest stage to a neighbour, if that clearly relieves the bottleneck.

    A stage's measured ``busy`` time is shared among its blocks in proportion to their ``weights``
    (the split's block costs); the move is the edge block toward a less busy neighbour whose
    predicted new maximum is lowest. It must lower the busiest stage's time by ``margin`` of it and by
    ``excess`` of its excess over the mean stage, so that on a space of many small blocks (each a few
    percent of a stage) repeated checks walk the cut toward balance, and near balance nothing moves.

    Args:
        ranges: the blocks of each stage now.
        busy: each stage's busy seconds over the same windows.
        weights: each block's cost estimate.
        forbidden: cut positions that must not be used (shared buffers, :func:`.partition.shared_buffer_cuts`).
        margin: the busiest stage must get at least this much faster (0.02: by 2%).
        excess: ... and faster by at least this share of its excess over the mean stage's busy time.

    Returns:
        The new ranges, or ``None`` when no move helps by ``margin``.
    """
    slowest = max(range(len(ranges)), key=lambda s: busy[s])
    best: tuple[float, list[range]] | None = None
    for neighbour, block in ((slowest - 1, ranges[slowest].start), (slowest + 1, ranges[slowest].stop - 1)):
        if not 0 <= neighbour < len(ranges) or len(ranges[slowest]) < 2:
            continue
        share = weights[block] / max(sum(weights[i] for i in ranges[slowest]), 1e-12)
        moved = busy[slowest] * share
        after = list(busy)
        after[slowest] -= moved
        after[neighbour] += moved
        cut = ranges[slowest].start + 1 if neighbour < slowest else ranges[slowest].stop - 1
        needed = max(margin * busy[slowest], excess * (busy[slowest] - sum(busy) / len(busy)))
        if cut in forbidden or max(after) > busy[slowest] - needed:
            continue
        new = list(ranges)
        if neighbour < slowest:
            new[neighbour], new[slowest] = range(new[neighbour].start, cut), range(cut, new[slowest].stop)
        else:
            new[slowest], new[neighbour] = range(new[slowest].start, cut), range(cut, new[neighbour].stop)
        if best is None or max(after) < best[0]:
            best = (max(after), new)
    return best[1] if best is not None else None
