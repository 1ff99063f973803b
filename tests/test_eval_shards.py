"""Sharded evaluation over data-parallel replicas (lightning_naspipe/integration/eval_shards.py,
``Engine.evaluate_shard``): each replica runs its share of the batches and every rank gets every output, bit for bit
the one-device evaluation's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from inprocess_grid import evaluate_grid
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from test_engine import FakeModule

SEED = 5


def _supernet() -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(
        nn.Linear(5, 8),
        lnp.ChoiceBlock([nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.ReLU())]),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)),
        lnp.ChoiceBlock([nn.Linear(8, 8), nn.Sequential(nn.Dropout(0.3), nn.Linear(8, 8))]),
        nn.Linear(8, 3),
    )


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(count)]


@pytest.mark.parametrize("stages, replicas", [(1, 2), (2, 2), (1, 3)])
def test_sharded_evaluation_equals_one_device_and_runs_each_batch_once(stages: int, replicas: int) -> None:
    """5 batches: groups of ``replicas`` and a shorter last one. Every rank holds every output, bitwise the one-device
    engine's, and the replicas ran the forwards between them once each (a stage's replica ``r`` ran group member
    ``r``)."""
    batches = _batches(5)
    reference = FakeModule(_supernet())
    reference.supernet.eval()
    architectures = [uniform_architecture(reference.supernet.labels, SEED, 100 + k) for k in range(len(batches))]
    one = Engine([range(len(reference.supernet))])
    with torch.inference_mode():
        expected = [one.evaluate(reference, b, a) for b, a in zip(batches, architectures)]  # type: ignore[arg-type]
    stage_blocks = [range(0, 2), range(2, 5)] if stages == 2 else [range(5)]
    grid = [[copy.deepcopy(reference) for _ in range(replicas)] for _ in stage_blocks]
    engines: list[list[Engine]] = []
    with torch.inference_mode():
        found = evaluate_grid(grid, stage_blocks, batches, architectures, engines)  # type: ignore[arg-type]
    for s in range(stages):
        for r in range(replicas):
            assert len(found[s][r]) == len(batches)
            assert all(torch.equal(a, b) for a, b in zip(expected, found[s][r])), f"stage {s} replica {r}"
            share = sum(1 for start in range(0, len(batches), replicas) if start + r < len(batches))
            assert engines[s][r].evaluations == share, (s, r)
    assert sum(engines[0][r].evaluations for r in range(replicas)) == len(batches)


def test_evaluate_shard_refuses_more_forwards_than_replicas_or_a_batch_where_none_runs() -> None:
    engine = Engine([range(5)])
    module: Any = FakeModule(_supernet())
    with pytest.raises(ValueError, match="one per replica"):
        engine.evaluate_shard(module, 1, _batches(1)[0], {}, torch.device("cpu"))
