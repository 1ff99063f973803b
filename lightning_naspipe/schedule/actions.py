"""Pipeline actions and per-stage schedules as plain data (see :mod:`.schedule` for the rules).

:class:`Action` is one unit of a stage's work (``F``/``B`` of a chunk, ``U`` of a subnet),
:class:`Schedule` the per-stage orders with their simulated ticks; :func:`validated` checks and
freezes a window's resources, as every function over them needs.
"""

from collections.abc import Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["BACKWARD", "FORWARD", "NORMS", "UPDATE", "Action", "CostFn", "DeadlockError", "Resources", "Schedule",
           "ScheduleError", "Ties", "check_int", "validated", "with_ties"]

FORWARD = "F"
BACKWARD = "B"
UPDATE = "U"
_KIND_NAMES = (FORWARD, BACKWARD, UPDATE)
#: The chunk slot of a norm message's ``(subnet, chunk)`` key: ``U(i)`` of a schedule with ``norms`` sends
#: ``(i, NORMS)`` up (to ``s-1``) and down (to ``s+1``), see :mod:`.grad_norm`. No chunk is negative.
NORMS = -1

Resources = Sequence[Sequence[AbstractSet[Hashable]]]
#: Resources tied across stages (a weight two stages hold, see :mod:`.ties`): key -> the stages that own a part of
#: it, i.e. step it and send its value to the later stages holding a copy.
Ties = Mapping[Hashable, AbstractSet[int]]
CostFn = Callable[[int, "Action"], int]
_K = TypeVar("_K", bound=Hashable)


class ScheduleError(AssertionError):
    """A schedule breaks a NASPipe rule; the message names the rule."""


class DeadlockError(ScheduleError):
    """Replaying the per-stage orders without a global clock gets stuck."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on a stage: ``F``/``B`` of a chunk, or ``U`` of a subnet."""

    kind: str
    subnet: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KIND_NAMES:
            raise ValueError(f"Action kind must be 'F', 'B' or 'U', got {self.kind!r}")
        if self.subnet < 0 or self.chunk < 0 or (self.kind == UPDATE and self.chunk != 0):
            raise ValueError(f"invalid Action {self.kind}{self.subnet}.{self.chunk}")

    def __str__(self) -> str:
        return f"U{self.subnet}" if self.kind == UPDATE else f"{self.kind}{self.subnet}.{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage execution orders plus the simulated start/finish tick of each action.

    With ``norms`` (global-norm gradient clipping, see :mod:`.grad_norm`) every stage's ``U(i)`` waits
    for ``B(i, *)`` and ``U(i-1)`` on every stage and exchanges one norm message with each neighbour.
    """

    stages: tuple[tuple[Action, ...], ...]
    start: Mapping[tuple[int, Action], int]
    finish: Mapping[tuple[int, Action], int]
    norms: bool = False

    @property
    def makespan(self) -> int:
        """Tick at which the last action of the window finishes."""
        return max(self.finish.values(), default=0)

    def sends(self, stage: int, direction: str) -> tuple[tuple[int, int], ...]:
        """Return ``(subnet, chunk)`` of each message ``stage`` sends, in send order.

        Args:
            stage: Sending stage.
            direction: ``"forward"`` (activations to ``stage+1``, one per F) or
                ``"backward"`` (gradients to ``stage-1``, one per B). With :attr:`norms`, each U also
                sends ``(subnet, NORMS)`` both ways.
        """
        if not 0 <= stage < len(self.stages):
            raise ValueError(f"stage {stage} out of range 0..{len(self.stages) - 1}")
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        kind, peer = (FORWARD, stage + 1) if direction == "forward" else (BACKWARD, stage - 1)
        if not 0 <= peer < len(self.stages):
            return ()
        if not self.norms:
            return tuple((a.subnet, a.chunk) for a in self.stages[stage] if a.kind == kind)
        return tuple((a.subnet, NORMS if a.kind == UPDATE else a.chunk) for a in self.stages[stage]
                     if a.kind in (kind, UPDATE))

    def table(self) -> str:
        """Render an ASCII timeline: one row per stage, one column per tick."""
        ticks = self.makespan
        rows = [["."] * ticks for _ in self.stages]
        for (s, a), begin in self.start.items():
            end = self.finish[(s, a)]
            rows[s][begin : end] = [str(a)] + ["-"] * (end - begin - 1)
        width = max([len(str(max(ticks - 1, 0)))] + [len(c) for row in rows for c in row])
        head = "tick | " + " ".join(str(t).rjust(width) for t in range(ticks))
        body = [f"s{s:<3} | " + " ".join(c.ljust(width) for c in row) for s, row in enumerate(rows)]
        return "\n".join(line.rstrip() for line in [head, *body])


def check_int(name: str, value: object, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def validated(resources: Resources, num_chunks: int) -> tuple[tuple[frozenset[Hashable], ...], ...]:
    """Check the inputs and freeze them; raise ``ValueError``/``TypeError`` naming the problem."""
    check_int("num_chunks", num_chunks, 1)
    if len(resources) == 0:
        raise ValueError("resources is empty: a window needs at least one subnet")
    if len(resources[0]) == 0:
        raise ValueError("resources[0] has zero stages: a pipeline needs at least one stage")
    for i, per_stage in enumerate(resources):
        if len(per_stage) != len(resources[0]):
            raise ValueError(f"ragged resources: subnet {i} has {len(per_stage)} stages, subnet 0 {len(resources[0])}")
        for s, keys in enumerate(per_stage):
            if not isinstance(keys, AbstractSet):
                raise TypeError(f"resources[{i}][{s}] must be a set of keys, got {type(keys).__name__}")
    return tuple(tuple(frozenset(keys) for keys in per_stage) for per_stage in resources)


def with_ties(resources: Sequence[Sequence[AbstractSet[_K]]], ties: Mapping[_K, AbstractSet[int]]
              ) -> list[list[frozenset[_K]]]:
    """``resources`` with each tied key also on its owner stages, for every subnet that has it on any stage.

    A tied resource is one resource across stages: its owner steps it with the gradients of every subnet that
    uses it anywhere, and its value for a later stage leaves the owner with the subnet's first forward there.
    So on the owner every such subnet conflicts with every other (CSP orders them there), and a subnet reading
    the key on a later stage gets, through the forward chain, the value after the last earlier update.
    """
    out = [[set(keys) for keys in per_stage] for per_stage in resources]
    for per_stage in out:
        used = set[_K]().union(*per_stage) & ties.keys()
        for key in used:
            for owner in ties[key]:
                per_stage[owner].add(key)
    return [[frozenset(keys) for keys in per_stage] for per_stage in out]
