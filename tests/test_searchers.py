"""Searchers are pure functions of the history: deterministic, resumable from any prefix, constraint-bound."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_naspipe as lnp
from lightning_naspipe.searchers import Record, Searcher, ranking_key


def _score(architecture: dict[str, int]) -> float:
    # A deterministic, tie-prone score: ties must go to the earlier evaluation.
    return float(sum(v * (i + 1) for i, v in enumerate(architecture.values())) % 7)


def _run(searcher: Searcher, labels: dict[str, int], maximize: bool = True,
         feasible: Callable[[dict[str, int]], bool] = lambda a: True, prefix: list[Record] | None = None,
         on_evaluate: Callable[[dict[str, int]], None] = lambda a: None) -> list[Record]:
    """The search loop of lnp.search, with _score as the evaluation."""
    history = list(prefix or [])
    while proposals := searcher.propose(labels, history, feasible, maximize):
        for architecture in proposals:
            on_evaluate(architecture)
            history.append(Record(len(history), architecture, _score(architecture), 0, 0))
    return history


SPACE = {"a": 4, "b": 3, "c": 5, "d": 1, "e": 2}


def test_random_search_draws_distinct_feasible_architectures_deterministically() -> None:
    feasible = lambda a: a["a"] != 0  # noqa: E731
    history = _run(lnp.RandomSearch(40, seed=3), SPACE, feasible=feasible)
    assert len(history) == 40 and len({tuple(r.architecture.items()) for r in history}) == 40
    assert all(feasible(r.architecture) for r in history)
    assert history == _run(lnp.RandomSearch(40, seed=3), SPACE, feasible=feasible)
    assert history != _run(lnp.RandomSearch(40, seed=4), SPACE, feasible=feasible)


def test_evolution_mutates_the_tournament_winner_in_one_label_and_ages_the_population() -> None:
    searcher = lnp.EvolutionSearch(population=6, sample_size=3, cycles=30, seed=1)
    history = _run(searcher, SPACE)
    assert len(history) == 36
    for record in history[6:]:
        population = history[record.index - 6:record.index]  # the 6 most recent: the oldest went out
        differences = [sum(m.architecture[k] != record.architecture[k] for k in SPACE) for m in population]
        assert 1 in differences  # a one-label mutation of a member
    best = min(history, key=lambda r: ranking_key(r, True))
    assert best.score == max(r.score for r in history) and best.index == min(
        r.index for r in history if r.score == best.score)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), cut=st.integers(0, 40), maximize=st.booleans(),
       kind=st.sampled_from(["random", "evolution"]))
def test_a_search_resumed_from_any_prefix_proposes_what_the_uninterrupted_one_did(
        seed: int, cut: int, maximize: bool, kind: str) -> None:
    rng = random.Random(seed)
    labels = {f"l{i}": rng.randint(1, 4) for i in range(rng.randint(2, 6))}
    size = math.prod(labels.values())
    searcher: Searcher = (lnp.RandomSearch(min(20, size), seed=seed) if kind == "random"
                          else lnp.EvolutionSearch(population=min(5, size), sample_size=2 if size > 1 else 1,
                                                   cycles=15, seed=seed))
    full = _run(searcher, labels, maximize)
    evaluated: list[dict[str, int]] = []
    resumed = _run(searcher, labels, maximize, prefix=full[:cut], on_evaluate=evaluated.append)
    assert resumed == full
    assert evaluated == [r.architecture for r in full[cut:]]  # nothing evaluated twice


def test_grid_search_covers_a_small_space_and_refuses_a_large_one() -> None:
    history = _run(lnp.GridSearch(), {"x": 2, "y": 3})
    assert [r.architecture for r in history] == [{"x": x, "y": y} for x in range(2) for y in range(3)]
    with pytest.raises(lnp.NASPipeConfigError, match="RandomSearch or EvolutionSearch"):
        _run(lnp.GridSearch(limit=5), {"x": 2, "y": 3})


def test_impossible_constraints_and_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="constraints"):
        _run(lnp.RandomSearch(5), SPACE, feasible=lambda a: False)
    with pytest.raises(lnp.NASPipeConfigError, match="fewer samples"):
        _run(lnp.RandomSearch(7), {"x": 2, "y": 3})  # only 6 architectures exist
    with pytest.raises(lnp.NASPipeConfigError, match="constraints"):
        # Three feasible architectures, pairwise 3 labels apart: no one-label mutation is feasible.
        _run(lnp.EvolutionSearch(3, 2, 5), SPACE, feasible=lambda a: a["a"] == a["b"] == a["c"] and a["e"] == 0)
    with pytest.raises(lnp.NASPipeConfigError, match="samples=0"):
        lnp.RandomSearch(0)
    with pytest.raises(lnp.NASPipeConfigError, match="sample_size must be at most population"):
        lnp.EvolutionSearch(population=2, sample_size=3, cycles=1)
