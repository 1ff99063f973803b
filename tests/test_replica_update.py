"""What an update costs data-parallel replicas beyond the gradient bytes: the slowest replica, the BatchNorm
replay and the per-tensor work, and the planner charging them."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from lightning_naspipe.planning.planner import simulate
from lightning_naspipe.planning.replica_update import expected_maximum, replica_update_ms
from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec


def test_the_expected_maximum_of_normal_draws_is_within_5_percent() -> None:
    rng = random.Random(0)
    for draws in (2, 3, 4, 8, 16):
        sampled = statistics.fmean(max(rng.gauss(0, 1) for _ in range(draws)) for _ in range(20000))
        assert expected_maximum(draws) == pytest.approx(sampled, rel=0.05)
    assert expected_maximum(1) == 0.0
    with pytest.raises(ValueError, match="draws must be >= 1"):
        expected_maximum(0)


def _op(replay_ms: float = 0.0) -> CandidateSpec:
    return CandidateSpec(3.0, 5.0, True, grad_bytes=0, grad_tensors=4, statistics_tensors=6, replay_ms=replay_ms)


def test_each_cost_scales_with_the_replicas_as_the_chain_pays_it() -> None:
    spec = SpaceSpec([BlockSpec(None, [_op()])], grad_tensor_ms=0.01, statistics_tensor_ms=0.1, replica_spread=0.2)
    ops = [_op(2.0), _op(1.0)]
    assert replica_update_ms(spec, ops, 1) == 0.0
    for replicas in (2, 3, 8):
        slowest = 0.2 * expected_maximum(replicas) * 2 * 8.0 * 1.5  # spread x E[max] x the stage's compute
        replay = (replicas - 1) * 1.5 * 3.0  # the later replicas one after another
        tensors = 2 * (replicas - 1) * 2 * (4 * 0.01 + 6 * 0.1)  # every hop down and back
        assert replica_update_ms(spec, ops, replicas, scale=1.5) == pytest.approx(slowest + replay + tensors)
    quiet = dataclasses.replace(spec, grad_tensor_ms=0.0, statistics_tensor_ms=0.0, replica_spread=0.0)
    assert replica_update_ms(quiet, [_op()], 4) == 0.0


def test_the_planner_charges_them_to_every_update_of_replicas_only() -> None:
    def spec(replay_ms: float = 0.0, **costs: float) -> SpaceSpec:
        return SpaceSpec([BlockSpec(None, [_op(replay_ms)]), BlockSpec("c", [_op(), _op()])], update_ms=0.0, **costs)
    plain, charged = spec(), spec(4.0, grad_tensor_ms=0.01, statistics_tensor_ms=0.02, replica_spread=0.1)
    assert simulate(charged, 1, 4, 2, subnets=16).makespan_ms == simulate(plain, 1, 4, 2, subnets=16).makespan_ms
    before, after = (simulate(s, 1, 4, 2, subnets=16, replicas=2).makespan_ms for s in (plain, charged))
    # One replica's view: compute halved (8 ms per op -> 4, replay 4 -> 2); one stage runs every action in turn, so
    # each of the 16 updates adds all of it.
    view = [dataclasses.replace(o, forward_ms=1.5, backward_ms=2.5, replay_ms=o.replay_ms / 2)
            for o in (_op(replay_ms=4.0), _op())]
    per_update = replica_update_ms(charged, view, 2)
    assert after - before == pytest.approx(16 * per_update, abs=16 * 0.02)  # whole ticks of 10 µs
