"""Measured block costs for the default stage split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.planning.block_timing import agreed_timed_weights, timed_block_weights
from lightning_naspipe.pipeline.partition import balanced_split, block_weights, stage_ranges


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


def test_timed_weights_are_every_ranks_mean_and_errors_reach_every_rank() -> None:
    net = _conv_net()
    mine = timed_block_weights(net, torch.randn(2, 3, 8, 8))
    gathered: list = []

    def two_ranks(value: object) -> list:  # this rank's timing, and another rank's of twice those times
        gathered.append(value)
        return [value, ([2 * w for w in mine], "")]

    weights = agreed_timed_weights(net, torch.randn(2, 3, 8, 8), two_ranks)
    assert gathered[0][1] == "" and len(weights) == len(mine)
    assert all(w > 0 for w in weights)
    elsewhere = agreed_timed_weights(net, torch.randn(2, 3, 8, 8), lambda value: [([1.0, 2.0, 3.0], ""),
                                                                                  ([3.0, 4.0, 5.0], "")])
    assert elsewhere == [2.0, 3.0, 4.0]  # the mean, the same on every rank
    with pytest.raises(lnp.NASPipeConfigError, match="Timing block 0 failed"):
        agreed_timed_weights(net, torch.randn(2, 3, 8, 8), lambda value: [value, (None, "Timing block 0 failed")])


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
