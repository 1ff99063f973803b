"""Searchers are pure functions of the history: deterministic, resumable from any prefix, constraint-bound."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.searching.searchers import Record, Searcher, SearchSpace, architecture_key, ranking_key


def _score(architecture: dict[str, int]) -> float:
    # A deterministic, tie-prone score: ties must go to the earlier evaluation.
    return float(sum(v * (i + 1) for i, v in enumerate(architecture.values())) % 7)


def _run(searcher: Searcher, labels: Mapping[str, int], maximize: bool = True,
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
       kind=st.sampled_from(["random", "evolution", "spos"]))
def test_a_search_resumed_from_any_prefix_proposes_what_the_uninterrupted_one_did(
        seed: int, cut: int, maximize: bool, kind: str) -> None:
    rng = random.Random(seed)
    labels = {f"l{i}": rng.randint(1, 4) for i in range(rng.randint(2, 6))}
    size = math.prod(labels.values())
    searchers: dict[str, Searcher] = {
        "random": lnp.RandomSearch(min(20, size), seed=seed),
        "evolution": lnp.EvolutionSearch(population=min(5, size), sample_size=2 if size > 1 else 1, cycles=15,
                                         seed=seed),
        "spos": lnp.SPOSSearch(population=1, parents=1, mutations=0, crossovers=0, generations=size, seed=seed)
        if size < 6 else lnp.SPOSSearch(population=6, parents=2, mutations=2, crossovers=2, mutation_prob=0.5,
                                        generations=min(5, size // 6), seed=seed),
    }
    searcher = searchers[kind]
    full = _run(searcher, labels, maximize)
    evaluated: list[dict[str, int]] = []
    resumed = _run(searcher, labels, maximize, prefix=full[:cut], on_evaluate=evaluated.append)
    assert resumed == full
    assert evaluated == [r.architecture for r in full[cut:]]  # nothing evaluated twice


def test_spos_generations_breed_from_the_best_so_far() -> None:
    space = {f"l{i}": 4 for i in range(6)}
    searcher = lnp.SPOSSearch(population=12, parents=3, mutations=0, crossovers=8, generations=5, seed=2)
    history = _run(searcher, space)
    assert len(history) == 60 and len({tuple(r.architecture.items()) for r in history}) == 60
    assert history == _run(searcher, space) and history != _run(lnp.SPOSSearch(12, 3, 0, 8, generations=5), space)
    for generation in range(1, 5):
        earlier = history[:12 * generation]
        parents = sorted(earlier, key=lambda r: ranking_key(r, True))[:3]
        children = history[12 * generation:12 * generation + 8]
        for child in children:  # crossover: every label from one of the top-3 parents
            assert all(child.architecture[k] in {p.architecture[k] for p in parents} for k in space)
    mutated = _run(lnp.SPOSSearch(12, 3, mutations=8, crossovers=0, mutation_prob=0.2, generations=3, seed=2), space)
    distance = [min(sum(c.architecture[k] != p.architecture[k] for k in space) for p in mutated[:12])
                for c in mutated[12:20]]
    assert min(distance) >= 1 and sum(distance) / len(distance) < 3  # a few labels redrawn, never a copy


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
    with pytest.raises(lnp.NASPipeConfigError, match="the space holds only 6"):
        _run(lnp.SPOSSearch(population=4, parents=2, mutations=1, crossovers=1, generations=2), {"x": 2, "y": 3})
    with pytest.raises(lnp.NASPipeConfigError, match="together at most population"):
        lnp.SPOSSearch(population=10, mutations=6, crossovers=6)
    with pytest.raises(lnp.NASPipeConfigError, match="sample_size must be at most population"):
        lnp.EvolutionSearch(population=2, sample_size=3, cycles=1)


# -- architectures that run the same subnet are one -------------------------------------------------


class _Gate(nn.Module):
    """A choice of activation ("gate"); with gate 1, also a choice of op ("gated") added to it (a When)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.act = lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label="gate")
        self.extra = lnp.When(lnp.ChoiceBlock([nn.Linear(width, width), nn.Tanh(), nn.Sigmoid()], label="gated"),
                              "gate", frozenset({1}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.extra(x)
        x = self.act(x)
        return x if extra is None else x + extra


def nested_blocks(width: int) -> list[nn.Module]:
    """Blocks whose labels are not always reached: "inner" sits in candidate 1 of "outer" and of "tail" (one
    label, two choices), "gated" in a When of "gate"; "last" is always reached. 144 architectures, 80 subnets."""
    def inner() -> lnp.ChoiceBlock:
        return lnp.ChoiceBlock([nn.Linear(width, width), nn.Tanh(), nn.Identity()], label="inner")

    return [lnp.ChoiceBlock([nn.Linear(width, width), nn.Sequential(nn.Linear(width, width), inner())], label="outer"),
            _Gate(width),
            lnp.ChoiceBlock([nn.Identity(), inner()], label="tail"),
            lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label="last")]


NESTED = lnp.Supernet(*nested_blocks(4)).eval()
NESTED_SPACE = SearchSpace(NESTED.labels, NESTED.canonical)


def _every(labels: dict[str, int]) -> list[dict[str, int]]:
    return [dict(zip(labels, values)) for values in itertools.product(*(range(n) for n in labels.values()))]


def test_canonical_forms_zero_the_labels_a_path_never_reaches() -> None:
    arch = {"outer": 0, "inner": 2, "gate": 0, "gated": 1, "tail": 0, "last": 1}
    assert NESTED.reachable_labels(arch) == {"outer", "gate", "tail", "last"}
    assert NESTED.canonical(arch) == {"outer": 0, "inner": 0, "gate": 0, "gated": 0, "tail": 0, "last": 1}
    tail = {**arch, "tail": 1, "gate": 1}  # "inner" reached through the other choice sharing its label
    assert NESTED.canonical(tail) == tail and NESTED.reachable_labels(tail) == set(NESTED.labels)
    assert len({architecture_key(NESTED.canonical(a)) for a in _every(NESTED.labels)}) == 80
    with pytest.raises(lnp.NASPipeConfigError, match="lacks a choice"):
        NESTED.canonical({"outer": 0})
    # A DARTS-style cell: the op of an edge its node did not choose is never reached.
    cell = lnp.Supernet(lnp.Cell(4, lambda i, j: lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label=f"e{i}{j}"),
                                 inputs=2, choose=1))
    arch = {"n2_inputs": 1, "e02": 1, "e12": 1, "n3_inputs": 2, "e03": 1, "e13": 1, "e23": 1}
    assert cell.canonical(arch) == {**arch, "e02": 0, "e03": 0, "e13": 0}  # node 2 takes 1, node 3 takes 2


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_equivalent_architectures_run_the_same_subnet(data: st.DataObject) -> None:
    arch = {label: data.draw(st.integers(0, count - 1), label) for label, count in NESTED.labels.items()}
    canonical = NESTED.canonical(arch)
    reached = NESTED.reachable_labels(arch)
    assert canonical == {k: v if k in reached else 0 for k, v in arch.items()}
    assert NESTED.canonical(canonical) == canonical and NESTED.reachable_labels(canonical) == reached
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(NESTED(x, arch), NESTED(x, canonical))
    for label in set(NESTED.labels) - reached:  # no unreached label matters; every reached one does
        assert NESTED.canonical({**arch, label: (arch[label] + 1) % NESTED.labels[label]}) == canonical
    for label in reached:
        assert NESTED.canonical({**arch, label: (arch[label] + 1) % NESTED.labels[label]}) != canonical


def _searcher(kind: str, seed: int) -> Searcher:
    return {"random": lnp.RandomSearch(40, seed=seed),
            "evolution": lnp.EvolutionSearch(population=6, sample_size=3, cycles=60, seed=seed),
            "spos": lnp.SPOSSearch(population=8, parents=3, mutations=3, crossovers=3, mutation_prob=0.3,
                                   generations=6, seed=seed),
            "grid": lnp.GridSearch()}[kind]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), cut=st.integers(0, 50), maximize=st.booleans(),
       kind=st.sampled_from(["random", "evolution", "spos", "grid"]))
def test_searchers_propose_each_subnet_once_as_its_canonical_form(seed: int, cut: int, maximize: bool,
                                                                  kind: str) -> None:
    searcher = _searcher(kind, seed)
    history = _run(searcher, NESTED_SPACE, maximize)
    keys = [architecture_key(r.architecture) for r in history]
    assert len(set(keys)) == len(keys)  # no architecture twice, and no two that differ only where never reached
    assert all(NESTED.canonical(r.architecture) == r.architecture for r in history)
    assert history == _run(searcher, NESTED_SPACE, maximize)  # deterministic for its seed
    if kind == "grid":  # proposes all at once, so lnp.search resumes it from the log, never from a prefix
        assert sorted(keys) == sorted({architecture_key(NESTED.canonical(a)) for a in _every(NESTED.labels)})
    else:
        assert _run(searcher, NESTED_SPACE, maximize, prefix=history[:cut]) == history  # resumable
    if kind == "evolution":  # 6 + 60 > 80 subnets minus the unreachable mutations: it may end early, never repeat
        assert 6 < len(history) <= 66


def test_evolution_ends_when_every_mutation_repeats_an_earlier_architecture() -> None:
    history = _run(lnp.EvolutionSearch(population=4, sample_size=2, cycles=50, seed=0), {"x": 2, "y": 3})
    assert sorted(architecture_key(r.architecture) for r in history) == sorted(
        architecture_key(a) for a in _every({"x": 2, "y": 3}))  # all 6, each once, then no more
