"""Measured block costs for the default stage split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.planning.block_cost import PathTimes
from lightning_naspipe.planning.block_timing import (agreed_timed_weights, spec_weights, timed_block_weights,
                                                    timed_share, weights_of)
from lightning_naspipe.pipeline.placement.partition import balanced_split, block_weights, stage_ranges


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


def test_ranks_time_a_share_each_and_agree_on_the_joined_weights_and_on_errors() -> None:
    net, example = _conv_net(), torch.randn(2, 3, 8, 8)
    shares = [timed_share(net, example, repeats=1, share=(rank, 2)) for rank in range(2)]
    # The choices' two candidates: one rank times each; the fixed blocks: both ranks.
    assert [len(v) for v in shares[0].forward[1]] == [1, 0] and [len(v) for v in shares[1].forward[1]] == [0, 1]
    assert len(shares[0].forward[0][0]) == len(shares[1].forward[0][0]) == 1
    sent: list = []

    def gather(value: object) -> list:  # what each rank sent, the same parts on every rank
        sent.append(value)
        return [(shares[0], ""), (shares[1], "")]

    weights = [agreed_timed_weights(net, example, gather, share=(rank, 2), repeats=1) for rank in range(2)]
    assert weights[0] == weights[1] == weights_of(PathTimes.merged(shares))
    assert all(message == "" and [len(v) for v in times.forward[1]] == ([1, 0], [0, 1])[rank]
               for rank, (times, message) in enumerate(sent))
    with pytest.raises(lnp.NASPipeConfigError, match="Timing block 0 failed"):
        agreed_timed_weights(net, example, lambda value: [value, (None, "Timing block 0 failed")])


def test_a_profile_gives_the_split_its_weights() -> None:
    from lightning_naspipe.planning.profile import profile_supernet

    net, example = _conv_net(), torch.randn(4, 3, 48, 48)
    spec = profile_supernet(net, example, repeats=1, engine_seconds=0, deferred=False, action_overhead_ms=0.0)
    assert spec_weights(spec) == [block.cost_ms / 1000 for block in spec.blocks]
    assert len(spec_weights(spec)) == len(net) and spec_weights(spec)[1] > spec_weights(spec)[5]  # as timed


class _Pair(nn.Module):
    """Passes ``(features, integer ids)`` along, as blocks with side inputs do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, ids = value
        return self.linear(x) + ids.float().unsqueeze(1), ids


def test_tuple_boundaries_with_integer_tensors_are_timed() -> None:
    net = lnp.Supernet(_Pair(), lnp.ChoiceBlock([_Pair(), _Pair()]), _Pair())
    weights = timed_block_weights(net, (torch.ones(3, 6), torch.arange(3)), per_block=2, repeats=1)
    assert len(weights) == 3 and all(w > 0 for w in weights)
    assert all(p.grad is None for p in net.parameters())
