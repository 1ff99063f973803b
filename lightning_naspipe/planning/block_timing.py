"""The default stage split's weights: each block's cost measured on the stage's device.

Parameter counts are a poor proxy for compute (convolutions at high resolution, attention), so the
strategy balances stages by time measured with :mod:`~lightning_naspipe.planning.block_cost`, on
one micro-batch of the first real batch (or of ``supernet_example_input``), measured by every rank at once
(as the stages run side by side), each rank a share of the paths, and joined. A profile of the space
(:mod:`.profile`) gives the same weights, reduced alike (:func:`spec_weights`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from lightning_naspipe.space.boundary import map_tensors
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.planning.block_cost import BlockFailure, PathTimes, time_paths
from lightning_naspipe.planning.space_spec import SpaceSpec, block_cost_ms
from lightning_naspipe.space.choice import candidates_of
from lightning_naspipe.space.supernet import BlockValue, Supernet

__all__ = ["agreed_timed_weights", "spec_weights", "timed_block_weights", "timed_share", "weights_of"]


def timed_block_weights(supernet: Supernet, example_input: BlockValue, per_block: int = 4, repeats: int = 2,
                        device: torch.device | None = None) -> list[float]:
    """Each block's measured forward + backward seconds for one subnet batch.

    Trains (forward and backward, no update) paths through copies of the first ``per_block``
    candidates of each choice block (:func:`time_paths`). A block's weight is ``block_cost_ms`` of those
    candidates' ``candidate_ms`` (planning/block_cost.py), in seconds. Runs inside a
    forked RNG on copies, so the supernet's weights, buffers and the global RNG are untouched.

    Args:
        supernet: the search space.
        example_input: what the first block receives for one subnet batch.
        per_block: candidates (and paths) timed per choice block.
        repeats: timed rounds.
        device: where to time (the stage's compute device); default: where the blocks and the input are.

    Raises:
        NASPipeConfigError: a block cannot run on the example input (or on the previous block's output).
    """
    return weights_of(timed_share(supernet, example_input, per_block, repeats, device))


def timed_share(supernet: Supernet, example_input: BlockValue, per_block: int = 4, repeats: int = 2,
                device: torch.device | None = None, share: tuple[int, int] = (0, 1)) -> PathTimes:
    """:func:`timed_block_weights`' timings before the reduction, of the paths ``share=(index, count)`` deals
    this process (:func:`time_paths`): join every share with :meth:`PathTimes.merged`, reduce with :func:`weights_of`.

    Raises:
        NASPipeConfigError: a block cannot run on the example input (or on the previous block's output).
    """
    copies = [[copy.deepcopy(op) for op in candidates_of(block)[:per_block]] for block in supernet.blocks]
    if device is not None:
        copies = [[op.to(device) for op in ops] for ops in copies]
        example_input = map_tensors(lambda t: t.to(device), example_input)
    with torch.random.fork_rng(devices=[]):
        try:
            return time_paths(copies, example_input, repeats, share=share)
        except BlockFailure as error:
            raise NASPipeConfigError(
                f"Timing {error} of the supernet on the example input. supernet_example_input must be what the "
                "first block receives for one subnet batch (pipeline_input(batch)); or pass "
                "NASPipeStrategy(balance=[...])."
            ) from error


def weights_of(times: PathTimes) -> list[float]:
    """Each block's weight in seconds: ``block_cost_ms`` of its timed candidates' forward + backward."""
    # The profile's reduction (planning/profile.py, BlockSpec.cost_ms), so split and planner see the same costs.
    return [block_cost_ms([sum(times.cost_ms(i, k)) for k in range(len(candidates))]) / 1000
            for i, candidates in enumerate(times.forward)]


def spec_weights(spec: SpaceSpec) -> list[float]:
    """The split's weights from a profile of one micro-batch: each block's ``cost_ms``, in seconds."""
    return [block.cost_ms / 1000 for block in spec.blocks]


def agreed_timed_weights(supernet: Supernet, example_input: BlockValue, gather: Callable[[Any], list[Any]],
                         device: torch.device | None = None, share: tuple[int, int] = (0, 1),
                         repeats: int = 2) -> list[float]:
    """:func:`timed_block_weights` measured by every rank at once, so every process splits alike.

    Every process times while the others do, as the stages compute side by side in training (both cores
    busy on a small host), not one rank on an idle machine; with ``share=(rank, ranks)`` each times its share of
    the paths (:func:`timed_share`), so the ranks together take about one rank's share of the time. ``gather``
    gives every rank's value in rank order (collective); the parts are joined in that order, so every rank
    gets the same weights. A timing error on any rank is raised on every rank."""
    timed: tuple[PathTimes | None, str]
    try:
        timed = (timed_share(supernet, example_input, repeats=repeats, device=device, share=share), "")
    except NASPipeConfigError as error:
        timed = (None, str(error))
    parts = gather(timed)
    message = next((message for _, message in parts if message), "")
    if message:
        raise NASPipeConfigError(message)
    return weights_of(PathTimes.merged([times for times, _ in parts]))
