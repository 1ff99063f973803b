"""The Pareto front of a search on any two axes, and a PNG of it (matplotlib, optional).

An axis is ``"score"`` (what records are ranked by: the penalized score under a latency penalty, the score
otherwise; better as the search says), ``"raw_score"`` (the score before any penalty), or a cost, lower being
better: ``"params"``, ``"flops"`` or ``"latency_ms"``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.searchers import Record, best_of

__all__ = ["AXES", "default_x", "pareto_front", "plot_search"]

#: The axes a front or a plot may take.
AXES = ("score", "raw_score", "params", "flops", "latency_ms")
_LABELS = {"params": "parameters", "flops": "MFLOPs per sample", "latency_ms": "latency (ms)"}


def default_x(history: Sequence[Record]) -> str:
    """``"latency_ms"`` when every record has a latency, else ``"flops"``."""
    return "latency_ms" if history and all(r.latency_ms is not None for r in history) else "flops"


def _value(record: Record, axis: str) -> float:
    value = record.ranked_score if axis == "score" else record.score if axis == "raw_score" else getattr(record, axis)
    if value is None:
        raise NASPipeConfigError(f"Record {record.index} has no {axis}: search with latency= (a LatencyTable, or "
                                 "'measured') to know each record's latency, or take another axis.")
    return float(value)


def _oriented(record: Record, axis: str, maximize: bool) -> float:
    """Lower is better: scores negated when higher is better, costs as they are."""
    if axis not in AXES:
        raise NASPipeConfigError(f"Unknown axis {axis!r}; take one of {', '.join(AXES)}.")
    value = _value(record, axis)
    return -value if maximize and axis in ("score", "raw_score") else value


def pareto_front(history: Sequence[Record], maximize: bool, x: str = "flops", y: str = "score") -> list[Record]:
    """The records no other record beats on both ``x`` and ``y``, from the best ``x`` on.

    The default, ``x="flops", y="score"``, is fewer FLOPs against a better score. Equal values on both: the
    earlier evaluation stays on the front, the later one does not.
    """
    front: list[Record] = []
    ordered = sorted(history, key=lambda r: (_oriented(r, x, maximize), _oriented(r, y, maximize), r.index))
    for record in ordered:
        if not front or _oriented(record, y, maximize) < _oriented(front[-1], y, maximize):
            front.append(record)
    return front


def plot_search(history: Sequence[Record], maximize: bool, path: str | os.PathLike[str],
                title: str | None = None, x: str | None = None, y: str = "score") -> Path:
    """Write a PNG of ``y`` against ``x``: every record, the Pareto front, those a budgeted search measured over its
    latency budget (crosses) and the best (never one of those).

    Args:
        history: the records, e.g. ``SearchResult.history``.
        maximize: whether higher scores are better.
        path: the PNG to write (its folder is created).
        title: the plot's title (default: how many architectures were evaluated).
        x: the horizontal axis (default: ``"latency_ms"`` when every record has a latency, else ``"flops"``).
        y: the vertical axis (default: the score records are ranked by).

    Returns:
        The path written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise NASPipeConfigError("Plotting a search needs matplotlib: pip install matplotlib.") from error
    if not history:
        raise NASPipeConfigError("plot_search got no records; run a search first.")
    x = default_x(history) if x is None else x
    front = pareto_front(history, maximize, x, y)
    over = [r for r in history if r.over_budget]  # measured over the latency budget: never the best
    best = best_of(history, maximize)

    def at(records: Sequence[Record], axis: str) -> list[float]:
        return [_value(r, axis) / (1e6 if axis == "flops" else 1) for r in records]

    def label(axis: str) -> str:
        if axis not in ("score", "raw_score"):
            return _LABELS[axis]
        penalized = axis == "score" and any(r.penalized_score is not None for r in history)
        return f"{'penalized ' if penalized else ''}score ({'higher' if maximize else 'lower'} is better)"

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    try:
        axes.scatter(at(history, x), at(history, y), s=14, color="0.6", label=f"evaluated ({len(history)})")
        axes.step(at(front, x), at(front, y), where="post", color="C0", marker="o", markersize=4,
                  label="Pareto front")
        if over:
            axes.scatter(at(over, x), at(over, y), s=40, marker="x", color="C1", zorder=3,
                         label=f"measured over the budget ({len(over)})")
        if best is not None:
            axes.scatter(at([best], x), at([best], y), s=80, marker="*", color="C3", zorder=3,
                         label=f"best (#{best.index})")
        axes.set_xlabel(label(x))
        axes.set_ylabel(label(y))
        axes.set_title(title or f"Search: {len(history)} architectures")
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.tight_layout()
        figure.savefig(target, dpi=120)
    finally:
        plt.close(figure)
    return target
