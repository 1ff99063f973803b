"""Searchers: which architectures to evaluate next, as a pure function of what was evaluated.

A searcher never keeps state between calls: :meth:`Searcher.propose` sees the whole history (in
evaluation order) and returns the next architectures, drawing randomness only from
``random.Random(f"{seed}:...")`` streams keyed by what it is deciding. So the same seed and the
same scores give the same search on any number of processes, and a search resumed from its log
proposes exactly what the uninterrupted one would have.

Architectures that differ only in labels their path never reaches run the same subnet
(:meth:`.supernet.Supernet.canonical`). The built-in searchers propose canonical forms only and
never one equivalent to an architecture of the history, so no subnet is evaluated twice.

Ties between equal scores go to the earlier evaluation (lower index), everywhere.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["EvolutionSearch", "GridSearch", "RandomSearch", "Record", "SPOSSearch", "SearchSpace", "Searcher"]

#: Tries per wanted architecture before a constraint counts as impossible to meet.
MAX_TRIES = 1000

#: An architecture as a hashable key (:func:`architecture_key`).
Key = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Record:
    """One evaluated architecture.

    Attributes:
        index: its position in the evaluation order (0, 1, ...).
        architecture: the subnet.
        score: its score (see :func:`lightning_naspipe.search`).
        params: parameters of the frozen subnet.
        flops: floating-point operations per sample of the frozen subnet's forward: those of the
            search's first batch (torch's FLOP counter) divided by its size.
        latency_ms: its latency in milliseconds when the search knows one (``None`` otherwise).
        latency_kind: ``"predicted"`` (by a :class:`~lightning_naspipe.LatencyTable`) or ``"measured"`` (its
            frozen subnet timed end to end), or ``None``.
        penalized_score: under a :class:`~lightning_naspipe.LatencyPenalty`, the score after the penalty, which
            rankings, the best and the Pareto front use; ``None`` without one.
        measured_latency_ms: its frozen subnet's latency timed end to end when a search under a table and a latency
            budget checked it before returning it as the best (``latency_ms`` stays the prediction); ``None`` when
            not checked.
        over_budget: whether that check measured it over the budget (beyond the search's margin): such a record is
            never the best. Neither of these two takes part in ``==`` (a measurement is noisy).
    """

    index: int
    architecture: Architecture
    score: float
    params: int
    flops: int
    latency_ms: float | None = None
    latency_kind: str | None = None
    penalized_score: float | None = None
    # Not compared: a measurement is noisy, and two searches under one table (or one on 1 and on 2 processes) are
    # equal on what they evaluated and predicted.
    measured_latency_ms: float | None = field(default=None, compare=False)
    over_budget: bool = field(default=False, compare=False)

    @property
    def ranked_score(self) -> float:
        """What the record is ranked by: the penalized score under a penalty, else the score."""
        return self.score if self.penalized_score is None else self.penalized_score


class SearchSpace(dict[str, int]):
    """The space a searcher sees: label -> candidate count, and which architectures are one.

    :func:`lightning_naspipe.search` passes one built from the supernet; a plain dict of labels
    stands for a space whose architectures are all different subnets.

    Args:
        labels: label -> candidate count.
        canonical: maps an architecture to the representative of those that run the same subnet
            (:meth:`.supernet.Supernet.canonical`); ``None``: every architecture is its own.
    """

    def __init__(self, labels: Mapping[str, int],
                 canonical: Callable[[Mapping[str, int]], Architecture] | None = None) -> None:
        super().__init__(labels)
        self._canonical = canonical
        # Searchers ask again for every record of the history at each call: remember the answers.
        self._known: dict[Key, Architecture] = {}

    def canonical(self, architecture: Mapping[str, int]) -> Architecture:
        """The representative of the architectures that run the same subnet as ``architecture`` (a new dict)."""
        if self._canonical is None:
            return dict(architecture)
        try:
            key = architecture_key(architecture)
            known = self._known.get(key)
        except TypeError:  # not an architecture: the supernet's canonical says what is wrong with it
            return self._canonical(architecture)
        if known is None:
            known = self._known[key] = self._canonical(architecture)
        return dict(known)


class Searcher(Protocol):
    """What :func:`lightning_naspipe.search` asks a searcher."""

    def propose(self, labels: Mapping[str, int], history: Sequence[Record],
                feasible: Callable[[Architecture], bool], maximize: bool) -> list[Architecture]:
        """The next architectures to evaluate (``[]``: the search is over).

        Args:
            labels: the space: label -> candidate count; under :func:`lightning_naspipe.search` a
                :class:`SearchSpace`, whose ``canonical`` tells which architectures are one subnet.
            history: every record so far, in evaluation order.
            feasible: whether an architecture meets the search's constraints.
            maximize: whether higher scores are better.
        """
        ...


def ranking_key(record: Record, maximize: bool) -> tuple[float, int]:
    """Sorts best first by :attr:`Record.ranked_score`; equal scores: the earlier evaluation first."""
    return (-record.ranked_score if maximize else record.ranked_score, record.index)


def best_of(history: Sequence[Record], maximize: bool) -> Record | None:
    """The best record by :func:`ranking_key`, never one measured over the latency budget (:attr:`Record.over_budget`);
    ``None`` when there is none."""
    return min((r for r in history if not r.over_budget), key=lambda r: ranking_key(r, maximize), default=None)


def _draw(labels: Mapping[str, int], rng: random.Random) -> Architecture:
    return {label: rng.randrange(count) for label, count in labels.items()}


def architecture_key(architecture: Mapping[str, int]) -> Key:
    """A hashable key of an architecture, the same whatever the dict's order."""
    return tuple(sorted(architecture.items()))


def _canonical(labels: Mapping[str, int]) -> Callable[[Mapping[str, int]], Architecture]:
    """``labels.canonical`` of a :class:`SearchSpace`; of a plain dict, a copy (each architecture is its own)."""
    return labels.canonical if isinstance(labels, SearchSpace) else dict


def _seen(labels: Mapping[str, int], records: Sequence[Record]) -> set[Key]:
    """The keys of the canonical forms of ``records``' architectures."""
    canonical = _canonical(labels)
    return {architecture_key(canonical(r.architecture)) for r in records}


def _sample_new(labels: Mapping[str, int], seed: str, feasible: Callable[[Architecture], bool],
                seen: set[Key]) -> Architecture:
    """A feasible canonical architecture not in ``seen``, from the stream ``seed``."""
    canonical = _canonical(labels)
    for attempt in range(MAX_TRIES):
        architecture = canonical(_draw(labels, random.Random(f"{seed}:{attempt}")))
        if _new(architecture, seen, feasible):
            return architecture
    raise NASPipeConfigError(
        f"No new architecture met the search's constraints in {MAX_TRIES} random draws: loosen max_params, "
        "max_flops or the constraint function, or ask for fewer samples than the space holds (architectures "
        "that differ only in labels their path never reaches count as one)."
    )


def _new(architecture: Architecture, seen: set[Key], feasible: Callable[[Architecture], bool]) -> bool:
    """Whether ``architecture`` is feasible and not in ``seen``; if so it joins ``seen``."""
    key = architecture_key(architecture)
    if key in seen or not feasible(architecture):  # seen first: feasibility may cost a FLOP count
        return False
    seen.add(key)
    return True


def _random_until(labels: Mapping[str, int], history: Sequence[Record], count: int, seed: int,
                  feasible: Callable[[Architecture], bool]) -> list[Architecture]:
    """Distinct feasible random architectures for evaluations ``len(history) .. count - 1``."""
    seen = _seen(labels, history)
    return [_sample_new(labels, f"{seed}:random:{k}", feasible, seen) for k in range(len(history), count)]


# The searchers subclass the protocol they implement: a dataclass with a base class is one that
# jsonargparse (LightningCLI) writes as class_path and init_args, so a printed config reloads.
@dataclass(frozen=True)
class RandomSearch(Searcher):
    """``samples`` distinct architectures, uniform at random among the feasible ones.

    Draws equivalent to an earlier one (equal, or different only in labels the path never
    reaches) are drawn again, and each architecture is proposed as its canonical form.

    Args:
        samples: how many architectures to evaluate.
        seed: the draw's seed.
    """

    samples: int
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, samples=self.samples)

    def propose(self, labels: Mapping[str, int], history: Sequence[Record],
                feasible: Callable[[Architecture], bool], maximize: bool) -> list[Architecture]:
        size = math.prod(labels.values())
        if self.samples > size:
            raise NASPipeConfigError(
                f"RandomSearch(samples={self.samples}): the space holds only {size} architectures; ask for fewer "
                "samples than the space holds, or use GridSearch() to evaluate all of them."
            )
        return _random_until(labels, history, self.samples, self.seed, feasible)


@dataclass(frozen=True)
class GridSearch(Searcher):
    """Every feasible architecture of a small space, in ``itertools.product`` order of the labels.

    Architectures that differ only in labels their path never reaches are one: each is proposed
    once, as its canonical form (which is the first of them in that order).

    Args:
        limit: refuse spaces with more architectures than this.
    """

    limit: int = 10_000

    def propose(self, labels: Mapping[str, int], history: Sequence[Record],
                feasible: Callable[[Architecture], bool], maximize: bool) -> list[Architecture]:
        size = math.prod(labels.values())
        if size > self.limit:
            raise NASPipeConfigError(
                f"GridSearch: the space holds {size} architectures, more than limit={self.limit}; use "
                "RandomSearch or EvolutionSearch, or raise the limit."
            )
        if history:
            return []
        canonical = _canonical(labels)
        every = (dict(zip(labels, values)) for values in itertools.product(*(range(n) for n in labels.values())))
        return [a for a in every if canonical(a) == a and feasible(a)]


@dataclass(frozen=True)
class EvolutionSearch(Searcher):
    """Regularized (aging) evolution (Real et al., 2019): tournament selection, mutation, oldest out.

    First ``population`` random architectures (as :class:`RandomSearch`). Then each of ``cycles``
    cycles samples ``sample_size`` members of the population (the ``population`` most recent
    evaluations), mutates the best of them in one label to another candidate, and evaluates the
    child, which replaces the oldest member. A child equivalent to an architecture evaluated before
    (equal, or different only in labels its path never reaches) is not proposed: the cycle draws
    another tournament and mutation. If all of :data:`MAX_TRIES` draws repeat earlier architectures,
    the population's neighbourhood is exhausted and the search ends before ``cycles`` children.

    Args:
        population: population size.
        sample_size: tournament size, ``1 <= sample_size <= population``.
        cycles: how many children to evaluate (at most; see above).
        seed: the search's seed.
    """

    population: int
    sample_size: int
    cycles: int
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, population=self.population, sample_size=self.sample_size)
        if self.sample_size > self.population or self.cycles < 0:
            raise NASPipeConfigError(
                f"EvolutionSearch(population={self.population}, sample_size={self.sample_size}, cycles={self.cycles})"
                ": sample_size must be at most population, and cycles at least 0."
            )

    def propose(self, labels: Mapping[str, int], history: Sequence[Record],
                feasible: Callable[[Architecture], bool], maximize: bool) -> list[Architecture]:
        if len(history) < self.population:
            return _random_until(labels, history, self.population, self.seed, feasible)
        cycle = len(history) - self.population
        if cycle >= self.cycles:
            return []
        members = list(history[-self.population:])
        mutable = [label for label, count in labels.items() if count > 1]
        canonical, seen, repeats = _canonical(labels), _seen(labels, history), 0
        for attempt in range(MAX_TRIES):
            rng = random.Random(f"{self.seed}:cycle:{cycle}:{attempt}")
            parent = min(rng.sample(members, self.sample_size), key=lambda r: ranking_key(r, maximize))
            child = dict(parent.architecture)
            if mutable:
                label = rng.choice(mutable)
                child[label] = rng.choice([v for v in range(labels[label]) if v != child[label]])
            child = canonical(child)
            repeats += architecture_key(child) in seen
            if _new(child, seen, feasible):
                return [child]
        if repeats == MAX_TRIES:
            return []  # every mutation drawn was evaluated before: nothing new is in reach
        raise NASPipeConfigError(
            f"EvolutionSearch: no mutation of the population met the search's constraints in {MAX_TRIES} tries "
            f"({repeats} repeated earlier architectures); loosen max_params, max_flops or the constraint function."
        )


@dataclass(frozen=True)
class SPOSSearch(Searcher):
    """Generational evolution as in Single Path One-Shot (Guo et al., 2020): top-k parents, mutation, crossover.

    Generation 0 is ``population`` random architectures. Each later generation evaluates
    ``population`` architectures never evaluated before (nor equivalent to one, see
    :class:`RandomSearch`): ``mutations`` children of a random parent
    among the ``parents`` best so far (each label redrawn with probability ``mutation_prob``), then
    ``crossovers`` children of two such parents (each label from either), then random ones to fill
    the generation. Defaults are the SPOS reference's.

    Args:
        population: architectures per generation.
        parents: how many of the best so far are parents (top-k).
        mutations: mutated children per generation (at most; fewer if the tries run out).
        crossovers: crossover children per generation (at most).
        mutation_prob: the chance that a mutation redraws a label.
        generations: generations including the random first one.
        seed: the search's seed.
    """

    population: int = 50
    parents: int = 10
    mutations: int = 25
    crossovers: int = 25
    mutation_prob: float = 0.1
    generations: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, population=self.population, parents=self.parents, generations=self.generations)
        if (self.mutations < 0 or self.crossovers < 0 or self.mutations + self.crossovers > self.population
                or not 0.0 < self.mutation_prob <= 1.0):
            raise NASPipeConfigError(
                f"SPOSSearch(population={self.population}, mutations={self.mutations}, crossovers="
                f"{self.crossovers}, mutation_prob={self.mutation_prob}): mutations and crossovers are at least 0 "
                "and together at most population; mutation_prob is in (0, 1]."
            )

    def propose(self, labels: Mapping[str, int], history: Sequence[Record],
                feasible: Callable[[Architecture], bool], maximize: bool) -> list[Architecture]:
        total = self.population * self.generations
        size = math.prod(labels.values())
        if total > size:
            raise NASPipeConfigError(
                f"SPOSSearch evaluates population x generations = {total} distinct architectures, but the space "
                f"holds only {size}; lower population or generations, or use GridSearch()."
            )
        if len(history) >= total:
            return []
        if len(history) < self.population:
            return _random_until(labels, history, self.population, self.seed, feasible)
        generation = len(history) // self.population
        before = history[:generation * self.population]  # a generation is bred from the whole ones before it
        best = sorted(before, key=lambda r: ranking_key(r, maximize))[:self.parents]
        seen = _seen(labels, before)
        rng = random.Random(f"{self.seed}:generation:{generation}")
        children = self._children(labels, [r.architecture for r in best], rng, feasible, seen)
        children += [_sample_new(labels, f"{self.seed}:generation:{generation}:random:{k}", feasible, seen)
                     for k in range(len(children), self.population)]
        return children[len(history) - len(before):]

    def _children(self, labels: Mapping[str, int], parents: list[Architecture], rng: random.Random,
                  feasible: Callable[[Architecture], bool], seen: set[Key]) -> list[Architecture]:
        def mutate() -> Architecture:
            parent = rng.choice(parents)
            return {label: rng.randrange(labels[label]) if rng.random() < self.mutation_prob else value
                    for label, value in parent.items()}

        def cross() -> Architecture:
            first, second = rng.choice(parents), rng.choice(parents)
            return {label: rng.choice((first[label], second[label])) for label in first}

        canonical = _canonical(labels)
        children: list[Architecture] = []
        for make, wanted in ((mutate, self.mutations), (cross, self.crossovers)):
            made = 0
            for _ in range(10 * wanted):  # the reference's bound: tries run out in a converged population
                if made == wanted:
                    break
                child = canonical(make())
                if _new(child, seen, feasible):
                    children.append(child)
                    made += 1
        return children


def _check_positive(searcher: object, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise NASPipeConfigError(f"{type(searcher).__name__}({name}={value!r}): {name} is a whole number >= 1.")
