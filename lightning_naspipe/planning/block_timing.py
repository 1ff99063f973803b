"""The default stage split's weights: each block's cost measured on the stage's device.

Parameter counts are a poor proxy for compute (convolutions at high resolution, attention), so the
strategy balances stages by time measured with :mod:`~lightning_naspipe.planning.block_cost`, on
one micro-batch of the first real batch (or of ``supernet_example_input``), measured on every rank at once
(as the stages run side by side) and averaged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from lightning_naspipe.transport.boundary import map_tensors
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.planning.block_cost import BlockFailure, time_paths
from lightning_naspipe.planning.space_spec import block_cost_ms
from lightning_naspipe.space.choice import candidates_of
from lightning_naspipe.space.supernet import BlockValue, Supernet


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
    copies = [[copy.deepcopy(op) for op in candidates_of(block)[:per_block]] for block in supernet.blocks]
    if device is not None:
        copies = [[op.to(device) for op in ops] for ops in copies]
        example_input = map_tensors(lambda t: t.to(device), example_input)
    with torch.random.fork_rng(devices=[]):
        try:
            times = time_paths(copies, example_input, repeats)
        except BlockFailure as error:
            raise NASPipeConfigError(
                f"Timing {error} of the supernet on the example input. supernet_example_input must be what the "
                "first block receives for one subnet batch (pipeline_input(batch)); or pass "
                "NASPipeStrategy(balance=[...])."
            ) from error
    # The profile's reduction (planning/profile.py), so split and planner see the same block costs.
    return [block_cost_ms([sum(times.cost_ms(i, k)) for k in range(len(candidates))]) / 1000
            for i, candidates in enumerate(times.forward)]


def agreed_timed_weights(supernet: Supernet, example_input: BlockValue, gather: Callable[[Any], list[Any]],
                         device: torch.device | None = None) -> list[float]:
    """:func:`timed_block_weights` measured on every rank at once and averaged, so every process splits alike.

    Every process times while the others do, as the stages compute side by side in training (both cores
    busy on a small host), not one rank on an idle machine. ``gather`` gives every rank's value in rank order
    (collective); a timing error on any rank is raised on every rank."""
    timed: tuple[list[float] | None, str]
    try:
        timed = (timed_block_weights(supernet, example_input, device=device), "")
    except NASPipeConfigError as error:
        timed = (None, str(error))
    parts = gather(timed)
    message = next((message for _, message in parts if message), "")
    if message:
        raise NASPipeConfigError(message)
    return [sum(weights[i] for weights, _ in parts) / len(parts) for i in range(len(parts[0][0]))]


