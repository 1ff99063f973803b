"""Score against FLOPs: the Pareto front of a search, and a PNG of it (matplotlib, optional)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.searchers import Record, ranking_key

__all__ = ["pareto_front", "plot_search"]


def pareto_front(history: Sequence[Record], maximize: bool) -> list[Record]:
    """The records no other record beats on both FLOPs (fewer) and score, by increasing FLOPs.

    Equal FLOPs and score: the earlier evaluation stays on the front, the later one does not.
    """
    front: list[Record] = []
    for record in sorted(history, key=lambda r: (r.flops, ranking_key(r, maximize))):
        if not front or ranking_key(record, maximize)[0] < ranking_key(front[-1], maximize)[0]:
            front.append(record)
    return front


def plot_search(history: Sequence[Record], maximize: bool, path: str | os.PathLike[str],
                title: str | None = None) -> Path:
    """Write a PNG of score against FLOPs: every record, the Pareto front and the best.

    Args:
        history: the records, e.g. ``SearchResult.history``.
        maximize: whether higher scores are better.
        path: the PNG to write (its folder is created).
        title: the plot's title (default: how many architectures were evaluated).

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
    front = pareto_front(history, maximize)
    best = min(history, key=lambda r: ranking_key(r, maximize))
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    try:
        axes.scatter([r.flops / 1e6 for r in history], [r.score for r in history], s=14, color="0.6",
                     label=f"evaluated ({len(history)})")
        axes.step([r.flops / 1e6 for r in front], [r.score for r in front], where="post", color="C0",
                  marker="o", markersize=4, label="Pareto front")
        axes.scatter([best.flops / 1e6], [best.score], s=80, marker="*", color="C3", zorder=3,
                     label=f"best (#{best.index})")
        axes.set_xlabel("MFLOPs per sample")
        axes.set_ylabel("score (higher is better)" if maximize else "score (lower is better)")
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
