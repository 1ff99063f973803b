from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.placement.partition import (
    balanced_split, block_weights, shared_buffer_cuts, stage_ranges,
)


def _net() -> lnp.Supernet:
    return lnp.Supernet(
        nn.Linear(10, 10),                                          # 110 parameters
        lnp.ChoiceBlock([nn.Linear(10, 10), nn.Identity()]),       # mean 55
        nn.ReLU(),                                                  # 0 -> counts as 1
        lnp.ChoiceBlock([nn.Linear(10, 10), nn.Linear(10, 10)]),   # 110
        nn.Linear(10, 2),                                           # 22
    )


def test_block_weights_are_expected_parameters_per_subnet() -> None:
    assert block_weights(_net()) == [110.0, 55.0, 1.0, 110.0, 22.0]


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.floats(0.5, 100.0), min_size=1, max_size=9), data=st.data())
def test_balanced_split_is_optimal(weights: list[float], data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, len(weights)))
    sizes = balanced_split(weights, stages)
    assert len(sizes) == stages and all(n >= 1 for n in sizes) and sum(sizes) == len(weights)

    def heaviest(cuts: tuple[int, ...]) -> float:
        bounds = [0, *cuts, len(weights)]
        return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))

    ours = tuple(itertools.accumulate(sizes))[:-1]
    every = itertools.combinations(range(1, len(weights)), stages - 1)  # all contiguous splits
    assert heaviest(ours) == pytest.approx(min(heaviest(c) for c in every))


def test_stage_ranges_default_and_explicit() -> None:
    net = _net()
    assert stage_ranges(net, 1) == [range(0, 5)]
    assert [len(r) for r in stage_ranges(net, 2)] == [2, 3]
    assert stage_ranges(net, 2, balance=[4, 1]) == [range(0, 4), range(4, 5)]


@pytest.mark.parametrize("stages, balance, needle", [
    (6, None, "only 5 blocks"),
    (2, [2, 2], "summing to the supernet's 5 blocks"),
    (2, [5, 0], "positive block count"),
    (3, [2, 3], "each of the 3 stages"),
])
def test_bad_partitions(stages: int, balance: list[int] | None, needle: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=needle):
        stage_ranges(_net(), stages, balance)


def test_tied_weights_may_span_stages_but_shared_buffers_stay_on_one() -> None:
    embedding, head = nn.Embedding(5, 4), nn.Linear(4, 5)
    head.weight = embedding.weight  # two modules, one Parameter: each stage holds a copy (pipeline.exactness.ties)
    net = lnp.Supernet(embedding, nn.ReLU(), nn.Linear(4, 4), lnp.ChoiceBlock([head, nn.Linear(4, 5)]), nn.Tanh())
    assert shared_buffer_cuts(net) == set()
    assert stage_ranges(net, 2, balance=[2, 3]) == [range(0, 2), range(2, 5)]
    assert len(stage_ranges(net, 3)) == 3
    norm = nn.BatchNorm1d(4)  # running statistics every forward changes: one stage
    net = lnp.Supernet(nn.Linear(4, 4), norm, nn.ReLU(), lnp.ChoiceBlock([norm, nn.Identity()]), nn.Tanh())
    assert shared_buffer_cuts(net) == {2, 3}
    assert stage_ranges(net, 2) in ([range(0, 1), range(1, 5)], [range(0, 4), range(4, 5)])
    with pytest.raises(lnp.NASPipeConfigError, match="share a buffer"):
        stage_ranges(net, 2, balance=[2, 3])
    with pytest.raises(lnp.NASPipeConfigError, match="shared buffers"):
        stage_ranges(net, 4)
