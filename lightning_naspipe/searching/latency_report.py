"""How far a latency table's predictions are from end-to-end measured latency: :class:`LatencyReport`."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from lightning_naspipe.space.choice import Architecture

__all__ = ["LatencyReport"]


@dataclass(frozen=True)
class LatencyReport:
    """How far a :class:`LatencyTable`'s predictions are from measured latency, on a sample of architectures.

    Attributes:
        rows: per architecture ``(architecture, predicted ms, measured ms)``.
        device: where both were measured.
        batch_size: the input's batch size.
    """

    rows: tuple[tuple[Architecture, float, float], ...]
    device: str
    batch_size: int

    @property
    def errors_pct(self) -> tuple[float, ...]:
        """Per row, ``100 * (predicted - measured) / measured``: positive when the table over-predicts."""
        return tuple(100.0 * (predicted - measured) / measured for _, predicted, measured in self.rows)

    @property
    def mean_abs_pct(self) -> float:
        """The mean absolute error, in percent of the measured latency."""
        return statistics.fmean(abs(e) for e in self.errors_pct)

    @property
    def worst_pct(self) -> float:
        """The largest absolute error, in percent of the measured latency."""
        return max(abs(e) for e in self.errors_pct)

    @property
    def bias_pct(self) -> float:
        """The mean signed error in percent: a systematic over- (positive) or under-prediction."""
        return statistics.fmean(self.errors_pct)

    def __str__(self) -> str:
        lines = [f"{'predicted ms':>12} {'measured ms':>12} {'error %':>8}  architecture"]
        lines += [f"{p:>12.4f} {m:>12.4f} {e:>+8.1f}  {json.dumps(a)}"
                  for (a, p, m), e in zip(self.rows, self.errors_pct)]
        lines.append(f"{len(self.rows)} architectures on {self.device}, batch size {self.batch_size}: mean |error| "
                     f"{self.mean_abs_pct:.1f}%, worst {self.worst_pct:.1f}%, bias {self.bias_pct:+.1f}%")
        return "\n".join(lines)
