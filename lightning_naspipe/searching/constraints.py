"""Hardware-aware constraints: ranges of parameters, FLOPs and latency, and MnasNet's soft latency penalty.

One :class:`Constraints` object holds several ranges at once; :func:`lightning_naspipe.search` filters by it (hard
constraints) and scores by its :class:`LatencyPenalty` (a soft one), and the training-time sampler
:class:`~lightning_naspipe.Constrained` draws only architectures it admits, so a supernet can be trained on the
deployable range only. Latency is either predicted by a :class:`~.latency.LatencyTable` (deterministic) or measured
end to end (``latency="measured"``: search only, since a measurement is noisy and training must be exact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.sampling.step_sampling import frozen_shapes
from lightning_naspipe.searching.latency import LatencyTable, batch_size_of
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import Supernet

__all__ = ["Constraints", "LatencyPenalty", "sizes_of"]

#: ``Constraints(latency=MEASURED)``: each architecture's frozen subnet timed end to end.
MEASURED = "measured"

#: How many of its best architectures a search under a table and ``max_latency_ms`` times end to end, at most, before
#: it returns one (``Constraints.check_top``).
CHECK_TOP = 5

#: How far over ``max_latency_ms`` a checked architecture may measure and still be returned: 5% (timing noise; a
#: table's error is typically larger, which is what the check catches) (``Constraints.check_margin``).
CHECK_MARGIN = 0.05


@dataclass(frozen=True)
class LatencyPenalty:
    """MnasNet's soft latency constraint: ``reward = score * (latency / target_ms) ** w``.

    ``w = alpha`` when the latency is at most ``target_ms``, else ``beta``. MnasNet's soft setting is
    ``alpha = beta = -0.07`` (faster than the target earns a little, slower costs a little); ``alpha = 0, beta = -1``
    is its hard-ish one. For a higher-is-better score (accuracy) the reward is ``score * factor``; for a
    lower-is-better one (a loss) it is ``score / factor``, so the penalty pushes the same way (a slow subnet's loss
    grows). Either way the score must be at least 0.

    Args:
        target_ms: the target latency in milliseconds (> 0).
        alpha: the exponent at or under the target.
        beta: the exponent over the target.
    """

    target_ms: float
    alpha: float = -0.07
    beta: float = -0.07

    def __post_init__(self) -> None:
        if not self.target_ms > 0:
            raise NASPipeConfigError(f"LatencyPenalty(target_ms={self.target_ms}): give a target latency > 0 ms.")

    def factor(self, latency_ms: float) -> float:
        """``(latency_ms / target_ms) ** w``."""
        return float((latency_ms / self.target_ms) ** (self.alpha if latency_ms <= self.target_ms else self.beta))

    def apply(self, score: float, latency_ms: float, maximize: bool) -> float:
        """The penalized score of a record with ``score`` and ``latency_ms`` (see the class)."""
        if score < 0:
            raise NASPipeConfigError(f"LatencyPenalty needs scores >= 0 (a product with a latency factor); got "
                                     f"{score}. Score with a non-negative metric, or drop the penalty.")
        return score * self.factor(latency_ms) if maximize else score / self.factor(latency_ms)


@dataclass(frozen=True)
class Constraints:
    """Ranges an architecture must lie in, any of them at once, and an optional soft latency penalty.

    Every bound is inclusive and optional (``None``: unbounded). Parameters are those of the frozen subnet; FLOPs
    are per sample (torch's FLOP counter on one batch's forward divided by its size: the search's first batch, or
    ``example_input`` in training); latency is in milliseconds, predicted by ``latency`` (a table, or the path of
    one saved with ``LatencyTable.save``) or measured (``latency="measured"``, search only).

    Args:
        min_params: the fewest parameters.
        max_params: the most parameters.
        min_flops: the fewest FLOPs per sample.
        max_flops: the most FLOPs per sample.
        min_latency_ms: the lowest latency.
        max_latency_ms: the highest latency.
        latency: a :class:`~lightning_naspipe.LatencyTable`, a path to one, or ``"measured"``; needed by a latency
            bound or a penalty.
        penalty: a :class:`LatencyPenalty` on the search's scores (records keep the raw score too).
        repeats: with ``latency="measured"``, timed runs per architecture.
        example_input: what the first block receives, to count FLOPs during training (the search counts them on
            its first batch instead).
        check_top: with a table and ``max_latency_ms``, the search times its best architectures end to end, in
            ranking order, until one measures within the budget, at most this many (0: no check; see
            :func:`lightning_naspipe.search`).
        check_margin: a checked architecture is within the budget when it measures at most
            ``max_latency_ms * (1 + check_margin)`` (timing noise).

    Raises:
        NASPipeConfigError: a range with its minimum above its maximum, a latency bound or a penalty without a
            latency source, an unknown ``latency`` string, or a negative ``check_top`` or ``check_margin``.
    """

    min_params: Optional[int] = None
    max_params: Optional[int] = None
    min_flops: Optional[int] = None
    max_flops: Optional[int] = None
    min_latency_ms: Optional[float] = None
    max_latency_ms: Optional[float] = None
    latency: Union[LatencyTable, str, None] = None
    penalty: Optional[LatencyPenalty] = None
    repeats: int = 10
    example_input: Any = None
    check_top: int = CHECK_TOP
    check_margin: float = CHECK_MARGIN
    #: Training-time sizes per (supernet, canonical architecture): (params, FLOPs or None).
    _sizes: dict[Any, tuple[int, Optional[int]]] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        for name in ("params", "flops", "latency_ms"):
            low, high = getattr(self, f"min_{name}"), getattr(self, f"max_{name}")
            if low is not None and high is not None and low > high:
                raise NASPipeConfigError(f"Constraints(min_{name}={low}, max_{name}={high}): an empty range; give "
                                         f"min_{name} <= max_{name}.")
        if isinstance(self.latency, str) and self.latency != MEASURED:
            object.__setattr__(self, "latency", LatencyTable.load(self.latency))  # a saved table's path
        if self.latency is None and self.bounds_latency:
            raise NASPipeConfigError(
                f"Constraints(min_latency_ms={self.min_latency_ms}, max_latency_ms={self.max_latency_ms}) needs "
                "latency=lnp.LatencyTable.measure(...) (or .load, or a saved table's path) to predict each "
                "architecture's latency, or latency='measured' to time it.")
        if self.latency is None and self.penalty is not None:
            raise NASPipeConfigError("Constraints(penalty=...) needs latency= (a LatencyTable, its path, or "
                                     "'measured'): the penalty is a function of each architecture's latency.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise NASPipeConfigError(f"Constraints(repeats={self.repeats!r}): give an int >= 1.")
        if isinstance(self.check_top, bool) or not isinstance(self.check_top, int) or self.check_top < 0:
            raise NASPipeConfigError(f"Constraints(check_top={self.check_top!r}): give an int >= 0 (0: no check).")
        if (isinstance(self.check_margin, bool) or not isinstance(self.check_margin, (int, float))
                or not 0 <= self.check_margin < float("inf")):
            raise NASPipeConfigError(f"Constraints(check_margin={self.check_margin!r}): give a fraction >= 0, e.g. "
                                     "0.05 for 5%.")

    @property
    def measured(self) -> bool:
        """Whether latency is measured end to end (not predicted by a table)."""
        return self.latency == MEASURED

    @property
    def table(self) -> LatencyTable | None:
        """The latency table, if latency is predicted."""
        return self.latency if isinstance(self.latency, LatencyTable) else None

    @property
    def latency_kind(self) -> str | None:
        """``"predicted"``, ``"measured"`` or ``None`` (no latency known)."""
        return None if self.latency is None else "measured" if self.measured else "predicted"

    @property
    def bounds_latency(self) -> bool:
        """Whether a latency bound is set."""
        return self.min_latency_ms is not None or self.max_latency_ms is not None

    @property
    def checks_winner(self) -> bool:
        """Whether a search checks its best architectures end to end: latency predicted by a table, a maximum set,
        and ``check_top > 0``."""
        return self.table is not None and self.max_latency_ms is not None and self.check_top > 0

    @property
    def budget_ms(self) -> float | None:
        """What a checked architecture may measure at most: ``max_latency_ms * (1 + check_margin)``, or ``None``."""
        return None if self.max_latency_ms is None else self.max_latency_ms * (1 + self.check_margin)

    @property
    def bounds_size(self) -> bool:
        """Whether a parameter or FLOP bound is set."""
        return any(v is not None for v in (self.min_params, self.max_params, self.min_flops, self.max_flops))

    @property
    def active(self) -> bool:
        """Whether anything is constrained, penalized or measured."""
        return self.bounds_size or self.bounds_latency or self.latency is not None

    def within(self, params: int | None = None, flops: int | None = None, latency_ms: float | None = None) -> bool:
        """Whether each value given lies in its range (values not given are not checked)."""
        return all(value is None or ((low is None or value >= low) and (high is None or value <= high))
                   for value, low, high in ((params, self.min_params, self.max_params),
                                            (flops, self.min_flops, self.max_flops),
                                            (latency_ms, self.min_latency_ms, self.max_latency_ms)))

    def check(self, supernet: Supernet) -> None:
        """Refuse, before anything is evaluated, a table of another supernet and a latency range it cannot meet."""
        table = self.table
        if table is None:
            return
        table.check(supernet)
        where = f"on {table.device} at batch size {table.batch_size}"
        if self.max_latency_ms is not None and table.fastest_ms() > self.max_latency_ms:
            raise NASPipeConfigError(
                f"Constraints(max_latency_ms={self.max_latency_ms}): no architecture can meet it: the fastest "
                f"predicted is {table.fastest_ms():.3f} ms {where}. Raise the budget.")
        if self.min_latency_ms is not None and table.slowest_ms() < self.min_latency_ms:
            raise NASPipeConfigError(
                f"Constraints(min_latency_ms={self.min_latency_ms}): no architecture can meet it: the slowest "
                f"predicted is {table.slowest_ms():.3f} ms {where}. Lower the minimum.")

    def check_sizes(self, supernet: Supernet) -> None:
        """Refuse a parameter or FLOP range (FLOPs on ``example_input``) no architecture of ``supernet`` can meet,
        counted from the space before anything is drawn (:func:`~.bounds.refuse_impossible`)."""
        from lightning_naspipe.searching.bounds import refuse_impossible  # bounds counts what these ranges ask

        refuse_impossible(self, supernet, self.example_input)

    def describe(self) -> str:
        """The ranges in words, e.g. ``"params in [1000, 5000], predicted latency <= 3.0 ms"``."""
        parts = []
        for name, low, high, unit in (("params", self.min_params, self.max_params, ""),
                                      ("FLOPs per sample", self.min_flops, self.max_flops, ""),
                                      (f"{self.latency_kind} latency", self.min_latency_ms, self.max_latency_ms,
                                       " ms")):
            if low is not None and high is not None:
                parts.append(f"{name} in [{low}, {high}]{unit}")
            elif low is not None:
                parts.append(f"{name} >= {low}{unit}")
            elif high is not None:
                parts.append(f"{name} <= {high}{unit}")
        return ", ".join(parts) or "no ranges"

    def settings(self) -> dict[str, Any]:
        """What a search's scores and choices depend on (for its log's fingerprint): every field but the example
        input and the winner check's (``check_top``, ``check_margin``: it decides on logged measurements, so a log
        resumes under other ones), the table by its entries (and its nested deltas, where it has any)."""
        table = self.table
        return {"ranges": [self.min_params, self.max_params, self.min_flops, self.max_flops, self.min_latency_ms,
                           self.max_latency_ms],
                "latency": None if self.latency is None else MEASURED if table is None else
                [table.entries, table.labels, table.device, table.batch_size, *([table.nested] * bool(table.nested))],
                "penalty": None if self.penalty is None else dataclasses.astuple(self.penalty),
                "repeats": self.repeats if self.measured else None}

    # -- training time: lnp.Constrained ------------------------------------------------------------

    def check_training(self) -> None:
        """Refuse what a training-time sampler cannot do exactly: measured latency, or FLOPs without an input."""
        if self.measured:
            raise NASPipeConfigError(
                "Constraints(latency='measured') cannot steer training: a measurement is noisy, so the stage "
                "processes would disagree on the architectures and a resumed run would differ. Give a "
                "LatencyTable (lnp.LatencyTable.measure(...) or its path), whose predictions are deterministic.")
        if (self.min_flops is not None or self.max_flops is not None) and self.example_input is None:
            raise NASPipeConfigError(
                "Constraints(min_flops/max_flops) in training needs example_input=... (what the first block "
                "receives for one batch) to count each architecture's FLOPs on.")

    def admits(self, supernet: Supernet, architecture: Architecture) -> bool:
        """Whether ``architecture`` lies in every range, by its parameters, its FLOPs on ``example_input`` and its
        predicted latency (what :class:`~lightning_naspipe.Constrained` asks; sizes cached per architecture)."""
        self.check_training()
        table = self.table
        if table is not None and not self.within(latency_ms=table.predict(architecture, supernet)):
            return False  # the cheapest test first
        if not self.bounds_size:
            return True
        params, flops = self._size(supernet, architecture)
        return self.within(params=params, flops=flops)

    def _size(self, supernet: Supernet, architecture: Architecture) -> tuple[int, int | None]:
        key = (id(supernet), tuple(sorted(supernet.canonical(architecture).items())))
        if key not in self._sizes:
            net = frozen_shapes(supernet, architecture)
            if self.min_flops is None and self.max_flops is None:
                self._sizes[key] = (sum(p.numel() for p in net.parameters()), None)
            else:
                self._sizes[key] = sizes_of(net.eval(), self.example_input)
        return self._sizes[key]


def sizes_of(net: nn.Module, example_input: Any) -> tuple[int, int]:
    """``net``'s parameters, and its FLOPs per sample on ``example_input`` (torch's FLOP counter on one forward
    without gradients, divided by the batch size)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(example_input)
    return sum(p.numel() for p in net.parameters()), int(counter.get_total_flops()) // batch_size_of(example_input)
