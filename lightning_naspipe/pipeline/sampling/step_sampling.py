"""Several subnets per training step: the sandwich rule and FairNAS's strict fairness.

A step sampler is a pure function of ``(supernet, seed, step)`` returning the architectures trained in that
step, in the order their gradients accumulate (the engine runs them on the step's batch like micro-batches,
then steps the optimizer once). Assign one as ``self.step_sampler`` in the module's ``__init__``; the mixin's
``sample_step`` calls it. Like ``sample_subnet``, it never draws from the global RNG: every stage process
evaluates it on its own, and resume relies on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from torch import nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.sampling.keyed import SAMPLER_DOMAIN, mix, uniform_architecture
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import Supernet

__all__ = ["ArchitectureRange", "Constrained", "FairNAS", "Sandwich", "covers_every_candidate", "frozen_shapes",
           "parameter_counts", "subnet_parameters"]

_FAIR_DOMAIN = 0xFA12
_CONSTRAINED_DOMAIN = 0xC0A5


def parameter_counts(supernet: Supernet, label: str) -> list[int]:
    """Parameters of the subnet taking each candidate of ``label`` (every other label at candidate 0)."""
    base = {name: 0 for name in supernet.labels}
    return [subnet_parameters(supernet, {**base, label: k}) for k in range(supernet.labels[label])]


def subnet_parameters(supernet: Supernet, architecture: Architecture) -> int:
    """The parameter count of ``architecture``'s frozen subnet (see :func:`frozen_shapes`)."""
    return sum(p.numel() for p in frozen_shapes(supernet, architecture).parameters())


def frozen_shapes(supernet: Supernet, architecture: Architecture) -> nn.Sequential:
    """``supernet.freeze(architecture)`` on any process: for what shapes alone decide (parameters, FLOPs), counted on a
    stage process during training too, where ``freeze`` would refuse blocks whose weights are elsewhere."""
    held, supernet.local_blocks = supernet.local_blocks, None
    try:
        return supernet.freeze(architecture)
    finally:
        supernet.local_blocks = held


class Sandwich:
    """The sandwich rule (BigNAS, AttentiveNAS, once-for-all): the largest subnet, the smallest, and
    ``num_random`` uniform ones, on the same batch, one optimizer step.

    The largest (smallest) takes, per label, the candidate whose subnet has the most (fewest) parameters,
    each label counted with every other at candidate 0 (:func:`parameter_counts`; ties: the later candidate is
    the larger, the earlier the smaller), measured once per supernet.

    Args:
        num_random: uniform architectures after the largest and the smallest.
    """

    def __init__(self, num_random: int = 2) -> None:
        if isinstance(num_random, bool) or not isinstance(num_random, int) or num_random < 0:
            raise NASPipeConfigError(f"Sandwich(num_random={num_random!r}): give an int >= 0, e.g. Sandwich(2).")
        self.num_random = num_random
        self._extremes: dict[int, tuple[Architecture, Architecture]] = {}

    def extremes(self, supernet: Supernet) -> tuple[Architecture, Architecture]:
        """The largest and the smallest architectures of ``supernet``."""
        if id(supernet) not in self._extremes:
            counts = {label: parameter_counts(supernet, label) for label in supernet.labels}
            largest = {label: _extreme(c, max) for label, c in counts.items()}
            smallest = {label: _extreme(c, min) for label, c in counts.items()}
            self._extremes[id(supernet)] = (largest, smallest)
        return self._extremes[id(supernet)]

    def __call__(self, supernet: Supernet, seed: int, step: int) -> list[Architecture]:
        largest, smallest = self.extremes(supernet)
        labels = supernet.labels
        uniform = [uniform_architecture(labels, mix(SAMPLER_DOMAIN, seed, step), r) for r in range(self.num_random)]
        return [dict(largest), dict(smallest), *uniform]

    def __repr__(self) -> str:
        return f"Sandwich(num_random={self.num_random})"


class FairNAS:
    """FairNAS's strict fairness: each step trains ``n`` subnets that together take every candidate of every
    choice exactly once (``n``: the candidates per choice, which must be equal), each label's candidates
    dealt in an order drawn from ``(seed, step, label)``."""

    def __call__(self, supernet: Supernet, seed: int, step: int) -> list[Architecture]:
        counts = set(supernet.labels.values())
        if len(counts) != 1:
            raise NASPipeConfigError(
                f"FairNAS trains every candidate of every choice once per step, so every choice needs as many "
                f"candidates; this supernet's choices have {dict(supernet.labels)}. Use Sandwich or the default "
                "sampler, or give every choice the same number of candidates."
            )
        n = counts.pop()
        orders = {label: _permutation(n, seed, step, position) for position, label in enumerate(supernet.labels)}
        return [{label: order[j] for label, order in orders.items()} for j in range(n)]

    def __repr__(self) -> str:
        return "FairNAS()"


class ArchitectureRange(Protocol):
    """What :class:`Constrained` asks of a ``constraints`` object: :class:`lightning_naspipe.Constraints` (defined
    with the search, which this layer does not import) is one."""

    def check_training(self) -> None:
        """Refuse what cannot steer training exactly (e.g. measured latency)."""
        ...

    def check(self, supernet: Supernet) -> None:
        """Refuse a range ``supernet`` cannot meet, or one measured on another supernet."""
        ...

    def check_sizes(self, supernet: Supernet) -> None:
        """Refuse a parameter or FLOP range no architecture of ``supernet`` can meet, counted from the space."""
        ...

    def admits(self, supernet: Supernet, architecture: Architecture) -> bool:
        """Whether ``architecture`` lies in the range."""
        ...

    def describe(self) -> str:
        """The range in words."""
        ...


class Constrained:
    """``num_subnets`` uniform architectures per step, each within a parameter range, admitted by ``constraints``
    and accepted by ``constraint``: deterministic rejection (draw ``attempt`` of subnet ``j`` of step ``s`` is a
    pure function of ``(seed, s, j, attempt)``), at most ``max_attempts`` draws each.

    Args:
        min_params: the fewest parameters a subnet may have (its frozen module's), or ``None``.
        max_params: the most, or ``None``.
        constraint: any other test of an architecture, or ``None``; a
            :class:`~lightning_naspipe.Constraints` here counts as ``constraints``.
        num_subnets: architectures per step.
        max_attempts: draws per architecture before the range counts as empty.
        constraints: the same :class:`~lightning_naspipe.Constraints` a search takes: ranges of parameters,
            FLOPs (on its ``example_input``) and predicted latency (its ``LatencyTable``), so the supernet trains
            on the deployable range only. Measured latency is refused: it is not deterministic.
    """

    def __init__(self, min_params: int | None = None, max_params: int | None = None,
                 constraint: Callable[[Architecture], bool] | None = None, num_subnets: int = 1,
                 max_attempts: int = 1000, constraints: ArchitectureRange | None = None) -> None:
        if min_params is not None and max_params is not None and min_params > max_params:
            raise NASPipeConfigError(f"Constrained(min_params={min_params}, max_params={max_params}): an empty range; "
                                     "give min_params <= max_params.")
        if constraints is None and hasattr(constraint, "admits"):  # Constrained(constraint=lnp.Constraints(...))
            constraints, constraint = constraint, None  # type: ignore[assignment]
        if constraints is not None:
            constraints.check_training()
        self.min_params, self.max_params, self.constraint = min_params, max_params, constraint
        self.constraints = constraints
        self.num_subnets, self.max_attempts = num_subnets, max_attempts
        self._params: dict[tuple[int, tuple[tuple[str, int], ...]], int] = {}
        self._checked: set[int] = set()

    def params(self, supernet: Supernet, architecture: Architecture) -> int:
        """The parameters of ``architecture``'s frozen subnet (cached per canonical architecture)."""
        key = (id(supernet), tuple(sorted(supernet.canonical(architecture).items())))
        if key not in self._params:
            self._params[key] = subnet_parameters(supernet, architecture)
        return self._params[key]

    def accepts(self, supernet: Supernet, architecture: Architecture) -> bool:
        """Whether ``architecture`` is within the range, admitted by ``constraints`` and passes ``constraint``."""
        if self.constraints is not None and id(supernet) not in self._checked:
            # A range the space or the table cannot meet: refused before the first draw is judged.
            self.constraints.check(supernet)
            self.constraints.check_sizes(supernet)
            self._checked.add(id(supernet))
        if self.min_params is not None or self.max_params is not None:
            params = self.params(supernet, architecture)
            if (self.min_params is not None and params < self.min_params) or (
                    self.max_params is not None and params > self.max_params):
                return False
        if self.constraints is not None and not self.constraints.admits(supernet, architecture):
            return False
        return self.constraint is None or bool(self.constraint(architecture))

    def __call__(self, supernet: Supernet, seed: int, step: int) -> list[Architecture]:
        chosen = []
        for j in range(self.num_subnets):
            for attempt in range(self.max_attempts):
                architecture = uniform_architecture(supernet.labels, mix(_CONSTRAINED_DOMAIN, seed, step, j), attempt)
                if self.accepts(supernet, architecture):
                    chosen.append(architecture)
                    break
            else:
                within = "" if self.constraints is None else f" ({self.constraints.describe()})"
                raise NASPipeConfigError(
                    f"{self!r}: no architecture of {self.max_attempts} uniform draws (step {step}) is within the "
                    f"range{within}; widen min_params/max_params or the constraints' ranges, or relax the constraint."
                )
        return chosen

    def __repr__(self) -> str:
        return (f"Constrained(min_params={self.min_params}, max_params={self.max_params}, "
                f"constraint={self.constraint!r}, num_subnets={self.num_subnets}"
                + (f", constraints={self.constraints!r})" if self.constraints is not None else ")"))


def _extreme(counts: list[int], pick: Callable[..., tuple[int, int]]) -> int:
    """The candidate with the most (``max``) or fewest (``min``) parameters; ties go to the later candidate for
    ``max`` and to the earlier for ``min``."""
    return pick((count, k) for k, count in enumerate(counts))[1]


def _permutation(n: int, seed: int, step: int, position: int) -> list[int]:
    """A permutation of ``range(n)`` drawn from the counters alone (Fisher-Yates on splitmix draws)."""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = mix(_FAIR_DOMAIN, seed, step, position, i) % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def covers_every_candidate(architectures: list[Architecture], labels: Mapping[str, int]) -> bool:
    """Whether ``architectures`` take every candidate of every label exactly once (FairNAS's rule)."""
    return all(sorted(a[label] for a in architectures) == list(range(count)) for label, count in labels.items())
