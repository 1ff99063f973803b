from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.partition import (
    agreed_timed_weights,
    balanced_split,
    block_weights,
    check_no_shared_parameters,
    stage_ranges,
    timed_block_weights,
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


def test_tied_weights_across_stages_are_refused() -> None:
    tied = nn.Linear(4, 4)
    net = lnp.Supernet(tied, nn.ReLU(), lnp.ChoiceBlock([tied, nn.Identity()]))
    check_no_shared_parameters(net, [range(0, 3)])
    with pytest.raises(lnp.NASPipeConfigError, match="tied weights"):
        check_no_shared_parameters(net, [range(0, 2), range(2, 3)])


def _conv_net() -> lnp.Supernet:
    # Few parameters but much compute at high resolution first, many parameters and little compute last:
    # a parameter-count split and a time split disagree.
    return lnp.Supernet(
        nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
        lnp.ChoiceBlock([nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 5, padding=2)]),
        lnp.ChoiceBlock([nn.Conv2d(16, 16, 3, padding=1), nn.Dropout(0.5)]),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        nn.Linear(16, 512),
        nn.Linear(512, 512),
    )


def test_timed_weights_follow_compute_and_leave_everything_untouched() -> None:
    net = _conv_net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    example = torch.randn(4, 3, 48, 48)
    rng = torch.get_rng_state()
    weights = timed_block_weights(net, example, repeats=2)
    assert len(weights) == len(net) and all(w > 0 for w in weights)
    assert weights[1] > weights[5]  # convolutions at 48x48 cost more than a 512x512 linear on 4 rows
    assert block_weights(net)[1] < block_weights(net)[5]  # ... though they have fewer parameters
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())  # BN statistics too
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    ranges = stage_ranges(net, 2, weights=weights)
    assert [len(r) for r in ranges] == balanced_split(weights, 2)


def test_timing_a_wrong_example_input_names_the_block_and_the_fix() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="block 0 .*supernet_example_input"):
        timed_block_weights(_conv_net(), torch.randn(4, 5))  # 5 features, not a 3-channel image


def test_timed_weights_are_agreed_and_errors_reach_every_rank() -> None:
    net = _conv_net()
    sent: list = []

    def from_timing_rank(value: object) -> object:  # what the timing rank broadcasts, seen elsewhere
        sent.append(value)
        return value

    weights = agreed_timed_weights(net, torch.randn(2, 3, 8, 8), True, from_timing_rank)
    assert sent == [(weights, "")]
    assert agreed_timed_weights(net, None, False, lambda _: sent[0]) == weights  # never times itself
    error = (None, "Timing block 0 failed")
    with pytest.raises(lnp.NASPipeConfigError, match="Timing block 0 failed"):
        agreed_timed_weights(net, None, False, lambda _: error)
