"""Search spaces described by costs: JSON round trip and validation."""

from __future__ import annotations

import pytest

from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec, wide_spec
from test_planner import mixed_spec


def test_spec_json_round_trip_and_validation() -> None:
    spec = mixed_spec()
    spec.sync_ms = 1.5
    assert SpaceSpec.from_json(spec.to_json()) == spec
    assert spec.labels() == {"a": 3, "b": 2, "c": 4}
    with pytest.raises(ValueError, match="different candidate counts"):
        SpaceSpec([BlockSpec("x", [CandidateSpec(1, 1)]), BlockSpec("x", [CandidateSpec(1, 1)] * 2)])
    with pytest.raises(ValueError, match="exactly one"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(1, 1)] * 2)])
    with pytest.raises(ValueError, match="parallel_slowdown must be >= 1"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(1, 1)])], parallel_slowdown=0.5)
    with pytest.raises(ValueError, match="negative or NaN"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(float("nan"), 1)])])
    with pytest.raises(ValueError, match="negative or NaN"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(1, 1, True, False, -1.0, 0.5)])])
    with pytest.raises(ValueError, match="negative or NaN"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(1, 1, replay_ms=-0.5)])])
    with pytest.raises(ValueError, match="replica_spread must be >= 0"):
        SpaceSpec([BlockSpec(None, [CandidateSpec(1, 1)])], replica_spread=-0.1)
    passes = SpaceSpec([BlockSpec(None, [CandidateSpec(1, 2, True, False, 0.5, 1.5, 64, 2, 3, 0.25)])],
                       grad_tensor_ms=0.01, statistics_tensor_ms=0.02, replica_spread=0.1)
    assert SpaceSpec.from_json(passes.to_json()) == passes and passes.blocks[0].candidates[0].deferred_ms == (0.5, 1.5)


def test_wide_spec_has_equal_stateful_candidates() -> None:
    spec = wide_spec(5, blocks=3, block_ms=2.0)
    assert spec.labels() == {"block0": 5, "block1": 5, "block2": 5}
    assert all(c == CandidateSpec(2.0, 4.0, True) for b in spec.blocks for c in b.candidates)


def test_compute_scaled_scales_compute_and_keeps_the_rest() -> None:
    spec = SpaceSpec([BlockSpec(None, [CandidateSpec(1, 2, True, False, 0.5, 1.5, grad_bytes=8, grad_tensors=2,
                                                     statistics_tensors=3, replay_ms=0.25)]),
                      BlockSpec("x", [CandidateSpec(3, 4), CandidateSpec(5, 6, False)])], update_ms=0.2, sync_ms=1.0)
    doubled = spec.compute_scaled(lambda ms: ms * 2)
    assert doubled.blocks[0].candidates[0] == CandidateSpec(2, 4, True, False, 1.0, 3.0, grad_bytes=8, grad_tensors=2,
                                                            statistics_tensors=3, replay_ms=0.5)
    assert doubled.blocks[1].candidates == [CandidateSpec(6, 8), CandidateSpec(10, 12, False)]
    assert (doubled.update_ms, doubled.sync_ms, doubled.blocks[1].label) == (0.2, 1.0, "x")
    assert spec.blocks[0].candidates[0].forward_ms == 1  # a copy
