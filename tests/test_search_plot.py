"""The Pareto front of a search and its PNG."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_naspipe as lnp
from lightning_naspipe.searching.search_plot import pareto_front, plot_search
from lightning_naspipe.searching.searchers import Record


def _records(points: list[tuple[int, float]]) -> list[Record]:
    return [Record(i, {"a": i}, score, 0, flops) for i, (flops, score) in enumerate(points)]


def test_the_front_keeps_what_nothing_beats_on_both_flops_and_score() -> None:
    history = _records([(10, 0.5), (20, 0.7), (15, 0.4), (30, 0.7), (5, 0.2), (20, 0.7), (40, 0.9)])
    assert [r.index for r in pareto_front(history, maximize=True)] == [4, 0, 1, 6]
    assert [r.index for r in pareto_front(history, maximize=False)] == [4]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), maximize=st.booleans())
def test_no_record_dominates_a_front_member_and_every_other_is_dominated(seed: int, maximize: bool) -> None:
    rng = random.Random(seed)
    history = _records([(rng.randint(0, 5), float(rng.randint(0, 5))) for _ in range(rng.randint(1, 20))])
    better = (lambda a, b: a > b) if maximize else (lambda a, b: a < b)

    def dominates(a: Record, b: Record) -> bool:  # at most b's FLOPs and a better score, or equal and earlier
        return a.flops <= b.flops and (better(a.score, b.score) or (a.score == b.score and (
            a.flops < b.flops or a.index < b.index)))

    front = pareto_front(history, maximize)
    assert all(not dominates(r, f) for f in front for r in history)
    assert all(any(dominates(f, r) for f in front) for r in history if r not in front)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    history = _records([(10, 0.5), (20, 0.7), (15, 0.4)])
    path = plot_search(history, True, tmp_path / "sub" / "search.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = lnp.SearchResult(history, maximize=True)
    assert result.plot(tmp_path / "r.png").stat().st_size > 1000
    assert result.pareto_front() == pareto_front(history, True)
    with pytest.raises(lnp.NASPipeConfigError, match="no records"):
        plot_search([], True, tmp_path / "x.png")


def test_the_plot_never_stars_a_record_measured_over_the_budget(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import matplotlib.axes

    history = _records([(10, 0.5), (20, 0.7), (15, 0.4)])
    history[1] = dataclasses.replace(history[1], measured_latency_ms=9.0, over_budget=True)  # the best score
    labels: list[str | None] = []
    scatter = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda self, *args, **kwargs: labels.append(kwargs.get("label")) or scatter(self, *args,
                                                                                                    **kwargs))
    lnp.SearchResult(history, maximize=True).plot(tmp_path / "p.png")
    assert "best (#0)" in labels and "measured over the budget (1)" in labels and "best (#1)" not in labels
