"""Measured block costs for the default stage split.

Parameter counts are a poor proxy for compute (convolutions at high resolution, attention), so
when the module gives an example input the strategy balances stages by time measured here. The
blocks are timed *as training runs them*: whole paths through the supernet, forward block by
block and then backward block by block, path ``k`` taking candidate ``k`` of every choice block.
Timing an op alone, again and again on the same input, keeps its weights and activations in
cache and undercounts the blocks with many weights (seen: a SPOS CNN's stage shares off by 20
points).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.supernet import ChoiceBlock, Supernet


def timed_block_weights(supernet: Supernet, example_input: Any, per_block: int = 4, repeats: int = 2) -> list[float]:
    """Each block's measured forward + backward seconds for one subnet batch.

    Trains (forward and backward, no update) ``per_block`` paths through copies of the first
    ``per_block`` candidates of each choice block, one warm-up round and then ``repeats`` rounds.
    A block's weight is the mean over paths of its fastest round (other jobs on a machine only
    ever add time). Runs inside a forked RNG on copies, so the supernet's weights, buffers and
    the global RNG are untouched.

    Args:
        supernet: the search space.
        example_input: what the first block receives for one subnet batch.
        per_block: candidates (and paths) timed per choice block.
        repeats: timed rounds.

    Raises:
        NASPipeConfigError: a block cannot run on the example input (or on the previous block's output).
    """
    copies = [[copy.deepcopy(op) for op in _candidates(block)[:per_block]] for block in supernet.blocks]
    paths = max(len(ops) for ops in copies)
    fastest = [[float("inf")] * paths for _ in copies]
    with torch.random.fork_rng(devices=[]):
        for round_ in range(repeats + 1):
            for k in range(paths):
                seconds = _time_path([ops[k % len(ops)] for ops in copies], example_input)
                for b, took in enumerate(seconds):
                    if round_:  # round 0 warms up (allocator, lazy kernels)
                        fastest[b][k] = min(fastest[b][k], took)
    return [sum(times) / len(times) for times in fastest]


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


def _candidates(block: nn.Module) -> list[nn.Module]:
    return list(block.candidates) if isinstance(block, ChoiceBlock) else [block]


def _time_path(path: list[nn.Module], x: Any) -> list[float]:
    """Seconds per block of one forward and backward along ``path``, each block its own graph
    (as each pipeline stage is)."""
    inputs, outputs, seconds = [], [], []
    index = 0
    try:
        for index, op in enumerate(path):
            x = _leaf(x)
            start = time.perf_counter()
            y = op(x)
            seconds.append(time.perf_counter() - start)
            inputs.append(x)
            outputs.append(y)
            x = y
        grads: list[Tensor] | None = None  # the gradients for the current block's outputs
        for index in reversed(range(len(path))):
            start = time.perf_counter()
            outs = _tensors(outputs[index])
            pairs = [(o, g) for o, g in zip(outs, grads if grads is not None else [None] * len(outs))
                     if o.requires_grad]
            if pairs and grads is None:  # the last block: a stand-in loss
                torch.autograd.backward([o.float().sum() for o, _ in pairs])
            elif pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            seconds[index] += time.perf_counter() - start
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _tensors(inputs[index])]
    except Exception as error:
        raise NASPipeConfigError(
            f"Timing block {index} of the supernet on the example input failed ({type(error).__name__}: {error}). "
            "supernet_example_input must be what the first block receives for one subnet batch "
            "(pipeline_input(batch)); or pass NASPipeStrategy(balance=[...])."
        ) from error
    return seconds


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    return [v for v in value if isinstance(v, Tensor)] if isinstance(value, (tuple, list)) else []


def _leaf(value: Any) -> Any:
    """``value`` cut from any graph, its floating-point tensors requiring grad (a stage's input)."""
    def leaf(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(t.is_floating_point())

    if isinstance(value, Tensor):
        return leaf(value)
    if isinstance(value, (tuple, list)):
        return type(value)(leaf(v) if isinstance(v, Tensor) else v for v in value)
    return value
