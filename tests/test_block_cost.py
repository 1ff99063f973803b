"""One measurement, one reduction: the split, the profile and the planner see the same block costs."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.planning import block_timing
from lightning_naspipe.planning import block_cost_ms, candidate_ms, profile, profile_supernet
from lightning_naspipe.planning.block_cost import BlockFailure, PathTimes, time_paths


def _net() -> lnp.Supernet:
    return lnp.Supernet(nn.Linear(4, 8), lnp.ChoiceBlock([nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8)]),
                        nn.Linear(8, 2))


def test_time_paths_times_every_candidate_once_per_round() -> None:
    ticks = itertools.count()
    ops: list[list[nn.Module]] = [[nn.Linear(4, 8)], [nn.Linear(8, 8), nn.ReLU()]]
    times = time_paths(ops, torch.randn(3, 4), repeats=2, clock=lambda: float(next(ticks)))
    # Every path's backward starts from no gradients, as a subnet's in training (accumulating into
    # the last path's gradients cost each backward an add per parameter and skewed the split).
    assert all(p.grad is None for candidates in ops for op in candidates for p in op.parameters())
    assert [len(k) for k in times.forward[1]] == [2, 2] and len(times.forward[0][0]) == 4  # warm-up dropped
    assert all(v > 0 for block in times.forward for k in block for v in k)
    assert times.input_backward == [] and times.deferred_ms(0, 0) is None
    deferred = time_paths([[nn.Linear(4, 8)], [nn.Linear(8, 8), nn.ReLU()]], torch.randn(3, 4), repeats=2,
                          clock=lambda: float(next(ticks)), deferred=True)
    assert [len(k) for k in deferred.input_backward[1]] == [2, 2] == [len(k) for k in deferred.weight_backward[1]]
    assert deferred.weight_backward[1][1] == [1.0, 1.0]  # ReLU has no weights: an empty pass, one tick
    assert all(v > 0 for block in deferred.input_backward for k in block for v in k)
    with pytest.raises(BlockFailure, match="block 1"):
        time_paths([[nn.Linear(4, 8)], [nn.Linear(5, 5)]], torch.randn(3, 4), repeats=1)


def test_the_split_and_the_profile_reduce_the_same_timings_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fixed timings (seconds) per block, per candidate, per round; both consumers get the same ones.
    forward = [[[0.004, 0.002]], [[0.003, 0.005], [0.001, 0.001], [0.009, 0.006]], [[0.002, 0.003]]]
    backward = [[[0.001, 0.003]], [[0.006, 0.002], [0.0, 0.0], [0.004, 0.004]], [[0.001, 0.001]]]
    fixed = PathTimes(forward, backward, [0.0005])
    monkeypatch.setattr(block_timing, "time_paths", lambda ops, *a, **k: fixed)
    monkeypatch.setattr(profile, "time_paths", lambda ops, *a, **k: fixed)
    split = block_timing.timed_block_weights(_net(), torch.randn(2, 4), per_block=3)
    spec = profile_supernet(_net(), torch.randn(2, 4), engine_seconds=0, action_overhead_ms=0.0)
    assert [b.cost_ms for b in spec.blocks] == pytest.approx([1000 * w for w in split], rel=1e-12)
    expected = block_cost_ms([candidate_ms(f) + candidate_ms(b) for f, b in zip(forward[1], backward[1])])
    # Each candidate: its median forward plus its median backward; the block: their mean.
    assert spec.blocks[1].cost_ms == pytest.approx(expected) == pytest.approx((4 + 4 + 1 + 0 + 7.5 + 4) / 3)


_CLOCK = [0.0]  # seconds; module level, so that the profile's copies of the ops advance it too


class _Tick(nn.Module):
    """Advances the test's clock by ``ms`` per forward: a candidate of known cost."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CLOCK[0] += self.ms / 1000
        return x * self.weight


def test_a_cell_costs_the_mean_over_its_nested_choices() -> None:
    # A fixed block whose edge is a choice (an NB201 cell): timed through every candidate of the
    # edge, its cost is their mean, not candidate 0's (1 ms) nor the median path's (3 ms).
    cell = nn.Sequential(lnp.ChoiceBlock([_Tick(1), _Tick(3), _Tick(8)], label="edge"))
    net = lnp.Supernet(nn.Linear(2, 2), cell)
    times = time_paths([[net.blocks[0]], [net.blocks[1]]], torch.randn(3, 2), repeats=3, clock=lambda: _CLOCK[0])
    assert sorted(set(times.variants[1][0])) == [(0,), (1,), (2,)]
    assert times.cost_ms(1, 0)[0] == pytest.approx((1 + 3 + 8) / 3)
    spec = profile_supernet(net, torch.randn(3, 2), clock=lambda: _CLOCK[0], engine_seconds=0, action_overhead_ms=0.0)
    assert spec.blocks[1].candidates[0].forward_ms == pytest.approx(4.0)


class _CountingSGD(torch.optim.SGD):
    """Advances the test's clock by 1 ms per parameter it steps: an update of known cost."""

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        _CLOCK[0] += sum(p.grad is not None for group in self.param_groups for p in group["params"]) / 1000
        super().step()


def test_the_update_costs_what_the_engine_steps_on_average_per_op_holding_state() -> None:
    # A cell whose edge trains a weight on one path and nothing on the other (a skip edge): the engine
    # steps 3 then 2 parameters (3 and 2 ms here) for 2 ops holding state, so a subnet's update is
    # 2.5 ms on average; the planner charges update_ms per such op. (Counting only the ops that
    # trained, and taking the median, gave 1.75 ms per op: 3.5 ms a subnet.)
    cell = nn.Sequential(lnp.ChoiceBlock([_Tick(0), nn.Identity()], label="edge"))
    net = lnp.Supernet(nn.Linear(2, 2), cell)
    spec = profile_supernet(net, torch.randn(3, 2), optimizer=lambda params: _CountingSGD(params, lr=0.1),
                            clock=lambda: _CLOCK[0], engine_seconds=0, action_overhead_ms=0.0)
    owners = sum(block.candidates[0].stateful for block in spec.blocks)
    assert owners == 2 and spec.update_ms * owners == pytest.approx((3 + 2) / 2)


def test_shares_of_the_paths_join_into_the_one_measurement() -> None:
    """Processes that each time a share of the paths (warm-up included) together time what one process does."""
    def ops() -> list[list[nn.Module]]:
        return [[nn.Linear(4, 8)], [nn.Linear(8, 8), nn.ReLU(), nn.Tanh()]]

    def sgd(ops_: list[list[nn.Module]]) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for c in ops_ for op in c for p in op.parameters()], lr=0.1)

    x = torch.randn(3, 4)
    whole_ops, part_ops = ops(), [ops(), ops()]
    whole = time_paths(whole_ops, x, repeats=2, optimizer=sgd(whole_ops), deferred=True)
    parts = [time_paths(o, x, repeats=2, optimizer=sgd(o), deferred=True, share=(i, 2)) for i, o in enumerate(part_ops)]
    assert [[len(v) for v in block] for block in parts[0].forward] == [[4], [2, 0, 2]]  # paths 0 and 2 of 3
    assert [[len(v) for v in block] for block in parts[1].forward] == [[2], [0, 2, 0]]
    merged = PathTimes.merged(parts)
    for series in ("forward", "backward", "input_backward", "weight_backward", "variants"):
        assert [[len(v) for v in block] for block in getattr(merged, series)] == \
            [[len(v) for v in block] for block in getattr(whole, series)], series
    assert len(merged.update) == len(whole.update) == 6
    assert merged.forward[1][1] == parts[1].forward[1][1] and merged.forward[0][0] == [*parts[0].forward[0][0],
                                                                                       *parts[1].forward[0][0]]
    assert merged.cost_ms(1, 2)[0] > 0 and all(v > 0 for v in merged.deferred_ms(1, 0) or ())
    with pytest.raises(ValueError, match=r"share must be \(index, count\)"):
        time_paths(ops(), x, repeats=1, share=(2, 2))


def test_profile_shares_join_into_the_profile_and_one_share_times_the_engine() -> None:
    net = lnp.Supernet(nn.Linear(2, 2), lnp.ChoiceBlock([_Tick(1), _Tick(3), _Tick(8)]), nn.Linear(2, 2))
    x = torch.randn(3, 2)
    whole = profile_supernet(net, x, repeats=1, clock=lambda: _CLOCK[0], engine_seconds=0, action_overhead_ms=0.0)
    shares = [profile.profile_share(net, x, clock=lambda: _CLOCK[0], share=(i, 2), engine_overhead=i == 1)
              for i in range(2)]
    assert shares[0].action_overhead_ms is None and shares[1].action_overhead_ms is not None
    joined = profile.spec_of(net, shares)
    assert [c.forward_ms for c in joined.blocks[1].candidates] == [c.forward_ms for c in whole.blocks[1].candidates]
    assert joined.blocks[1].candidates[2].forward_ms == pytest.approx(8.0)
    assert joined.action_overhead_ms == shares[1].action_overhead_ms
    assert joined.blocks[1].candidates[0].deferred_ms is not None
    # Without the deferred passes: None, which the planner models as a stage that never defers.
    assert profile.spec_of(net, [profile.profile_share(net, x, deferred=False, engine_overhead=False)]
                           ).blocks[1].candidates[0].deferred_ms is None


def test_the_profile_times_the_batch_norm_replay_and_counts_what_replicas_exchange() -> None:
    """A later replica replays each BatchNorm layer's statistics update in every update, and packs every gradient and
    statistics tensor: the profile times the one per candidate (0 without BatchNorm) and counts the others."""
    ticks = itertools.count()
    ops: list[list[nn.Module]] = [[nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))],
                                  [nn.BatchNorm2d(3), nn.BatchNorm2d(3, track_running_stats=False), nn.ReLU()]]
    times = time_paths(ops, torch.randn(2, 2, 4, 4), repeats=2, clock=lambda: float(next(ticks)), replay=True)
    assert times.replay_ms(0, 0) == times.replay_ms(1, 0) == 1000.0  # one tick: replayed, timed once
    assert times.replay_ms(1, 1) == times.replay_ms(1, 2) == 0.0  # nothing to replay: not timed
    assert all(not m._forward_pre_hooks for c in ops for op in c for m in op.modules())  # the hooks are gone
    assert time_paths(ops, torch.randn(2, 2, 4, 4), repeats=1).replay_ms(0, 0) == 0.0  # not asked for
    head = nn.Linear(48, 2)
    head.bias.requires_grad_(False)
    net = lnp.Supernet(nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)),
                       lnp.ChoiceBlock([nn.BatchNorm2d(3), nn.Identity()]), nn.Flatten(), head)
    spec = profile_supernet(net, torch.randn(2, 2, 4, 4), engine_seconds=0, action_overhead_ms=0.0)
    counts = [[(c.grad_tensors, c.statistics_tensors, c.replay_ms > 0) for c in b.candidates] for b in spec.blocks]
    assert counts == [[(4, 3, True)], [(2, 3, True), (0, 0, False)], [(0, 0, False)], [(1, 0, False)]]


class _SlowInTraining(_Tick):
    """Costs ``ms`` timed alone but twice that once the engine trains: as blocks whose weights fall out of cache."""

    training_ms: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CLOCK[0] += (self.ms if _SlowInTraining.training_ms is None else _SlowInTraining.training_ms * self.ms) / 1000
        return x * self.weight


def test_the_shares_engine_runs_scale_the_joined_profile_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each share also trains subnets of its own with the one-stage engine; the joined profile's compute is scaled so
    that it predicts those runs: here blocks cost twice as much in the engine as timed alone."""
    from lightning_naspipe.planning.planner import simulate
    from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture

    net = lnp.Supernet(lnp.ChoiceBlock([_SlowInTraining(1), _SlowInTraining(3)]),
                       lnp.ChoiceBlock([_SlowInTraining(2), _SlowInTraining(6)]))
    x = torch.randn(3, 2)
    real_run = profile.engine_run

    def slow_run(*args: object, **kwargs: object) -> profile.EngineRun:
        monkeypatch.setattr(_SlowInTraining, "training_ms", 2.0)
        try:
            return real_run(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            monkeypatch.setattr(_SlowInTraining, "training_ms", None)

    monkeypatch.setattr(profile, "engine_run", slow_run)
    alone = profile.spec_of(net, [profile.profile_share(net, x, clock=lambda: _CLOCK[0], share=(i, 2),
                                                        engine_overhead=False, deferred=False) for i in range(2)])
    shares = [profile.profile_share(net, x, clock=lambda: _CLOCK[0], share=(i, 2), engine_overhead=False,
                                    deferred=False, engine_seconds=1e-9) for i in range(2)]
    runs = [s.engine for s in shares]
    assert [(r.first, r.count) for r in runs if r is not None] == [(0, 4), (10**4, 4)]  # subnets of their own
    scaled = profile.spec_of(net, shares, action_overhead_ms=0.0)
    assert [c.forward_ms for b in scaled.blocks for c in b.candidates] == pytest.approx(
        [2 * c.forward_ms for b in alone.blocks for c in b.candidates], rel=0.02)
    predicted = sum(simulate(scaled, 1, r.window, architectures=[uniform_architecture(net.labels, 0, i)
                                                                for i in range(r.first, r.first + r.count)]
                             ).makespan_ms for r in runs if r is not None)
    assert predicted == pytest.approx(sum(r.ms for r in runs if r is not None), rel=0.02)
