"""lnp.Constraints: several ranges at once in a search, empty ranges refused clearly, MnasNet's soft penalty
reordering records exactly, the same object steering the training-time sampler, and Pareto fronts on two axes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import lightning_naspipe as lnp
from test_latency import _Net

#: Predictions: a0b0 2.75, a0b1 3.5, a1b0 4.25, a1b1 5.0, a2b0 11.25, a2b1 12.0 ms.
TABLE = lnp.LatencyTable(((1.0,), (0.5, 2.0, 9.0), (0.25, 1.0), (1.0,)), (None, "a", "b", None), "cpu", 8)
EVERY = [{"a": a, "b": b} for a, b in itertools.product(range(3), range(2))]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator))]


def _params(model: _Net, architecture: dict[str, int]) -> int:
    return sum(p.numel() for p in model.supernet.freeze(architecture).parameters())


def _record(index: int, score: float, ms: float, params: int = 10, penalty: lnp.LatencyPenalty | None = None,
            maximize: bool = True) -> lnp.Record:
    return lnp.Record(index, {"a": index}, score, params, 100 * params, ms, "predicted",
                      None if penalty is None else penalty.apply(score, ms, maximize))


def test_several_ranges_at_once_evaluate_exactly_the_architectures_within_all_of_them() -> None:
    model = _Net()
    limits = lnp.Constraints(min_params=100, max_params=5000, min_latency_ms=3.0, max_latency_ms=11.5, latency=TABLE)
    result = lnp.search(None, model, lnp.GridSearch(), _data(), constraints=limits)
    expected = [a for a in EVERY if 100 <= _params(model, a) <= 5000 and 3.0 <= TABLE.predict(a) <= 11.5]
    assert [r.architecture for r in result.history] == expected and 0 < len(expected) < len(EVERY)
    assert all(r.latency_ms == TABLE.predict(r.architecture) and r.latency_kind == "predicted"
               and r.penalized_score is None for r in result.history)
    # The keywords fold into the same object: the same search.
    folded = lnp.search(None, model, lnp.GridSearch(), _data(), max_params=5000, max_latency_ms=11.5,
                        constraints=lnp.Constraints(min_params=100, min_latency_ms=3.0, latency=TABLE))
    assert folded.history == result.history
    with pytest.raises(lnp.NASPipeConfigError, match="both given, differently"):
        lnp.search(None, model, lnp.GridSearch(), _data(), max_params=10,
                   constraints=lnp.Constraints(max_params=20))


def test_an_empty_range_is_a_clear_error_naming_it() -> None:
    model = _Net()
    with pytest.raises(lnp.NASPipeConfigError, match=r"Constraints\(min_params=10, max_params=5\): an empty range"):
        lnp.Constraints(min_params=10, max_params=5)
    with pytest.raises(lnp.NASPipeConfigError, match=r"min_latency_ms=3.0, max_latency_ms=2.0\): an empty range"):
        lnp.Constraints(min_latency_ms=3.0, max_latency_ms=2.0, latency=TABLE)
    with pytest.raises(lnp.NASPipeConfigError, match="needs latency="):
        lnp.Constraints(min_latency_ms=3.0)
    with pytest.raises(lnp.NASPipeConfigError, match="penalty=...\\) needs latency="):
        lnp.Constraints(penalty=lnp.LatencyPenalty(3.0))
    # Decided up front by the table: refused before anything is evaluated.
    evaluated: list[object] = []
    model.compute_loss = lambda output, batch: evaluated.append(1) or output.sum()  # type: ignore[method-assign]
    with pytest.raises(lnp.NASPipeConfigError, match=r"min_latency_ms=20.0\): no architecture can meet it: the "
                                                     r"slowest predicted is 12\.000 ms"):
        lnp.search(None, model, lnp.GridSearch(), _data(), constraints=lnp.Constraints(min_latency_ms=20.0,
                                                                                       latency=TABLE))
    assert evaluated == []
    # Decided by the searcher: the error names the ranges.
    model = _Net()
    with pytest.raises(lnp.NASPipeConfigError, match=r"GridSearch found no architecture within the constraints "
                                                     r"\(params >= 4400, predicted latency <= 5.0 ms\)"):
        lnp.search(None, model, lnp.GridSearch(), _data(),
                   constraints=lnp.Constraints(min_params=4400, max_latency_ms=5.0, latency=TABLE))
    with pytest.raises(lnp.NASPipeConfigError, match=r"The search's constraints: params in \[300, 4000\]"):
        lnp.search(None, model, lnp.RandomSearch(2), _data(), constraints=lnp.Constraints(min_params=300,
                                                                                          max_params=4000))


def test_the_penalty_reorders_known_records_as_mnasnet_specifies() -> None:
    penalty = lnp.LatencyPenalty(target_ms=10.0, alpha=-0.07, beta=-0.07)
    assert penalty.factor(20.0) == 2.0 ** -0.07 and penalty.factor(5.0) == 0.5 ** -0.07 and penalty.factor(10.0) == 1
    # Accuracy (higher is better): A is the most accurate but twice the target; B is half the target.
    records = [_record(0, 0.90, 20.0, penalty=penalty), _record(1, 0.88, 5.0, penalty=penalty),
               _record(2, 0.89, 10.0, penalty=penalty)]
    assert [r.penalized_score for r in records] == [0.90 * 2.0 ** -0.07, 0.88 * 0.5 ** -0.07, 0.89]
    result = lnp.SearchResult(records, maximize=True)
    assert [line.split()[1] for line in result.table().splitlines()[1:]] == ["1", "2", "0"]  # raw order: 0, 2, 1
    assert result.best_record.index == 1
    # A loss (lower is better) is divided by the factor: the slow record's loss grows, the fast one's shrinks.
    losses = [_record(0, 1.00, 20.0, penalty=penalty, maximize=False),
              _record(1, 1.05, 5.0, penalty=penalty, maximize=False)]
    assert [r.penalized_score for r in losses] == [1.00 / 2.0 ** -0.07, 1.05 / 0.5 ** -0.07]
    assert lnp.SearchResult(losses, maximize=False).best_record.index == 1
    # MnasNet's hard-ish setting (alpha 0): no reward under the target, only a cost over it.
    hard = lnp.LatencyPenalty(10.0, alpha=0.0, beta=-1.0)
    assert hard.apply(0.9, 5.0, True) == 0.9 and hard.apply(0.9, 20.0, True) == 0.45
    with pytest.raises(lnp.NASPipeConfigError, match="scores >= 0"):
        penalty.apply(-1.0, 5.0, True)


def test_a_search_under_a_penalty_ranks_by_the_penalized_score_and_keeps_the_raw_one() -> None:
    penalty = lnp.LatencyPenalty(2.75, alpha=0.0, beta=-2.0)
    plain = lnp.search(None, _Net(), lnp.GridSearch(), _data(), latency=TABLE)
    result = lnp.search(None, _Net(), lnp.GridSearch(), _data(),
                        constraints=lnp.Constraints(latency=TABLE, penalty=penalty))
    assert [r.score for r in result.history] == [r.score for r in plain.history]  # the raw scores, unchanged
    for r in result.history:
        assert r.penalized_score == r.score / penalty.factor(TABLE.predict(r.architecture))
    assert result.best_record == min(result.history, key=lambda r: (r.penalized_score, r.index))
    assert result.best != plain.best  # the penalty moved the winner to a faster subnet
    assert TABLE.predict(result.best) < TABLE.predict(plain.best)


def test_the_training_sampler_draws_only_within_the_same_constraints() -> None:
    model = _Net()
    limits = lnp.Constraints(min_params=100, max_latency_ms=5.0, latency=TABLE)
    feasible = [a for a in EVERY if _params(model, a) >= 100 and TABLE.predict(a) <= 5.0]
    for sampler in (lnp.Constrained(constraints=limits, num_subnets=3), lnp.Constrained(constraint=limits,
                                                                                         num_subnets=3)):
        drawn = [a for step in range(8) for a in sampler(model.supernet, 7, step)]
        assert len(drawn) == 24 and all(a in feasible for a in drawn)
        assert len({tuple(sorted(a.items())) for a in drawn}) > 1
        assert sampler(model.supernet, 7, 3) == drawn[9:12]  # a pure function of (seed, step)
    # FLOPs are counted on the constraints' example input.
    flops = lnp.Constrained(constraints=lnp.Constraints(max_flops=200, example_input=torch.randn(4, 4)))
    assert all(a["a"] != 2 for step in range(6) for a in flops(model.supernet, 1, step))
    with pytest.raises(lnp.NASPipeConfigError, match="cannot steer training"):
        lnp.Constrained(constraints=lnp.Constraints(latency="measured", max_latency_ms=3.0))
    with pytest.raises(lnp.NASPipeConfigError, match="needs example_input"):
        lnp.Constrained(constraints=lnp.Constraints(max_flops=100))
    with pytest.raises(lnp.NASPipeConfigError, match="no architecture can meet it"):
        lnp.Constrained(constraints=lnp.Constraints(max_latency_ms=1.0, latency=TABLE))(model.supernet, 0, 0)
    largest = max(_params(model, a) for a in EVERY)  # only a2b1, predicted 12.0 ms
    with pytest.raises(lnp.NASPipeConfigError, match=f"min_params={largest + 1:,}.*the largest has {largest:,}"):
        lnp.Constrained(constraints=lnp.Constraints(min_params=largest + 1))(model.supernet, 0, 0)  # up front
    # Each range alone is met, both at once are not: only the draws can tell.
    with pytest.raises(lnp.NASPipeConfigError, match=rf"within the range \(params >= {largest}, predicted latency"):
        lnp.Constrained(constraints=lnp.Constraints(min_params=largest, max_latency_ms=5.0, latency=TABLE),
                        max_attempts=20)(model.supernet, 0, 0)


def test_pareto_fronts_take_any_two_axes_and_default_to_latency_when_known(tmp_path: Path) -> None:
    records = [_record(0, 0.80, 2.0, params=50), _record(1, 0.85, 4.0, params=40), _record(2, 0.84, 3.0, params=90),
               _record(3, 0.83, 5.0, params=30), _record(4, 0.90, 9.0, params=60)]
    result = lnp.SearchResult(records, maximize=True)
    assert [r.index for r in result.pareto_front()] == [0, 2, 1, 4]  # latency x score
    assert [r.index for r in result.pareto_front(x="flops")] == [3, 1, 4]
    assert [r.index for r in result.pareto_front(x="params", y="latency_ms")] == [3, 1, 0]
    no_latency = lnp.SearchResult([lnp.Record(0, {"a": 0}, 1.0, 5, 9)], maximize=True)
    assert no_latency.pareto_front() == no_latency.history  # FLOPs by default
    with pytest.raises(lnp.NASPipeConfigError, match="has no latency_ms"):
        no_latency.pareto_front(x="latency_ms")
    with pytest.raises(lnp.NASPipeConfigError, match="Unknown axis 'speed'"):
        result.pareto_front(x="speed")
    pytest.importorskip("matplotlib")
    assert result.plot(tmp_path / "p.png", x="params", y="latency_ms").read_bytes()[:4] == b"\x89PNG"
    assert result.plot(tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
