"""Sharded evaluation over data-parallel replicas (lightning_naspipe/integration/eval_shards.py,
``Engine.evaluate_shard``): each replica runs its share of the batches and every rank gets every output, bit for bit
the one-device evaluation's."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from inprocess_grid import evaluate_grid
from lightning_naspipe.integration.eval_shards import EvalShards, LookaheadLoader, step_position
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


class _Loader:
    """A dataloader stand-in that counts reads."""

    def __init__(self, count: int) -> None:
        self.items, self.reads, self.batch_size = [(torch.full((2, 5), float(k)),) for k in range(count)], 0, 2

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        for item in self.items:
            self.reads += 1
            yield item


def test_the_lookahead_loader_yields_the_users_batches_and_reads_ahead_only_what_is_asked() -> None:
    source, started = _Loader(5), []
    loader = LookaheadLoader(source, started.append)
    assert len(loader) == 5 and loader.batch_size == 2
    loader.worker_init_fn = print  # Lightning sets it on the loader: it reaches the user's
    assert source.worker_init_fn is print  # type: ignore[attr-defined]
    iterator = iter(loader)
    assert started == [loader] and source.reads == 0
    first, second = next(iterator), next(iterator)
    assert loader.batches(0, 3) == source.items[:3] and source.reads == 3  # one read ahead, for the group
    assert [first, second, *iterator] == source.items  # the same objects, in order, each once
    assert source.reads == 5 and loader.batches(3, 4) == source.items[3:]
    assert list(loader) == source.items and len(started) == 2  # a new pass starts again


def _shards(limit: float = 5, hooks: bool = False) -> tuple[EvalShards, list[tuple[Any, ...]]]:
    calls: list[tuple[Any, ...]] = []
    shards = EvalShards(lambda batch, idx: ("prepared", batch), lambda idx: limit, lambda: torch.device("cpu"),
                        lambda: hooks)
    return shards, calls


class _ShardingEngine:
    """An engine of replica 1 of 2 whose ``evaluate_shard`` records its call and returns named outputs."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.replicas, self.calls = SimpleNamespace(replicas=2, replica=1), calls

    def evaluate_shard(self, module: Any, count: int, batch: Any, architecture: Any, device: Any) -> list[Any]:
        self.calls.append((count, batch, architecture))
        return [f"output {k}" for k in range(count)]


class _EvalModule(FakeModule):
    def eval_architecture(self, batch_idx: int, dataloader_idx: int = 0) -> dict[str, int]:
        return uniform_architecture(self.supernet.labels, SEED, 1000 + batch_idx)


def test_a_group_runs_this_replicas_batch_and_the_steps_of_the_group_take_their_outputs() -> None:
    shards, calls = _shards()
    module, engine = _EvalModule(_supernet()), _ShardingEngine([])
    module.supernet.eval()
    source = _Loader(5)
    batches = iter(shards.wrap(source))
    seen = [next(batches), next(batches)]  # Lightning's step 0, and the batch it fetched ahead

    def call(batch_idx: int, batch: Any, architecture: Any = None) -> Any:
        architecture = architecture or module.eval_architecture(batch_idx)
        with shards.step((batch, batch_idx, 0)):
            return shards.output(module, engine, batch, architecture)  # type: ignore[arg-type]

    step0 = ("step 0",)
    assert call(0, step0) == ("output 0",)
    assert engine.calls == [(2, ("prepared", source.items[1]), module.eval_architecture(1))]  # replica 1: batch 1
    assert call(0, step0) == ("output 0",) and call(1, ("step 1",)) == ("output 1",)  # no forward: the group's
    assert len(engine.calls) == 1
    # Another architecture (e.g. one of a fixed list evaluated on every batch): a group of its own, batches 1 and 2,
    # that predicts the same architecture for batch 2.
    fixed = module.eval_architecture(7)
    assert call(1, ("step 1",), fixed) == ("output 0",)
    assert engine.calls[1:] == [(2, ("prepared", source.items[2]), fixed)]
    seen.append(next(batches))
    assert call(2, ("step 2",), fixed) == ("output 1",) and len(engine.calls) == 2
    with shards.step((("step 2",), 2, 0)):  # a batch other than the step's: unsharded
        assert shards.output(module, engine, ("a copy",), fixed) is None  # type: ignore[arg-type]
    assert seen == source.items[:3] and (shards.groups, shards.sharded_calls, shards.unsharded_calls) == (2, 5, 1)


@pytest.mark.parametrize("case", ["training", "hooks", "last batch", "no batch_idx", "one replica"])
def test_sharding_falls_back_where_it_could_change_a_result(case: str) -> None:
    shards, calls = _shards(limit=1 if case == "last batch" else 5, hooks=case == "hooks")
    module, engine = _EvalModule(_supernet()), _ShardingEngine(calls)
    module.supernet.train(case == "training")
    if case == "one replica":
        engine.replicas = None  # type: ignore[assignment]
    batches = iter(shards.wrap(_Loader(5)))
    next(batches)
    batch = ("step 0",)
    with shards.step(None if case == "no batch_idx" else (batch, 0, 0)):
        assert shards.output(module, engine, batch, module.eval_architecture(0)) is None  # type: ignore[arg-type]
    assert calls == [] and shards.unsharded_calls == 1


def test_step_position_follows_lightnings_step_arguments() -> None:
    assert step_position(("b", 3), True) == ("b", 3, 0)
    assert step_position(("b", 3, 1), True) == ("b", 3, 1)
    assert step_position(("b", 1), False) is None  # (batch, dataloader_idx): the step takes no batch_idx
    assert step_position((iter([]),), True) is None  # the dataloader_iter flavour
