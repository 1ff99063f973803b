"""Where a stage's time goes: busy, waiting for neighbours, draining; and a timeline.

Each stage records its actions' wall-clock intervals. Per window it reports:

- ``busy``: forward, backward and update compute;
- ``data_wait``: blocked receiving an activation or gradient (the neighbour was not done yet:
  pipeline fill/drain, or the neighbour itself was held up by a CSP dependency);
- ``drain``: after its last action until the window's losses were shared (the rest of the
  pipeline finishing);
- ``in_flight``: the most subnets started but not yet updated on the stage at once.

The same intervals make a Chrome trace (``chrome://tracing`` or https://ui.perfetto.dev) and,
with matplotlib, a PNG timeline of the actual schedule.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Interval:
    name: str
    kind: str
    start: float
    end: float


@dataclass
class StageTelemetry:
    """Collects one stage's timeline.

    Args:
        stage: the stage's index (the trace's process id).
        keep_trace: keep every interval for :meth:`write_chrome_trace` (otherwise only totals).
    """

    stage: int
    keep_trace: bool = False
    totals: dict[str, float] = field(default_factory=lambda: {"busy": 0.0, "data_wait": 0.0, "drain": 0.0})
    in_flight_max: int = 0
    windows: int = 0
    _origin: float = field(default_factory=time.perf_counter)
    _intervals: list[_Interval] = field(default_factory=list)
    _window_start: float = 0.0
    _in_flight: set[int] = field(default_factory=set)
    _wait_in_action: float = 0.0
    last_action_end: float = 0.0

    def begin_window(self) -> None:
        self._window_start = time.perf_counter()
        self._in_flight.clear()

    def start_action(self) -> None:
        self._wait_in_action = 0.0

    def action(self, name: str, kind: str, subnet: int, start: float, end: float) -> None:
        """An F, B or U action ran from ``start`` to ``end`` (``time.perf_counter`` seconds),
        including any wait reported through :meth:`waited` since :meth:`start_action`."""
        start += self._wait_in_action  # the wait (receiving its input) came first
        self.totals["busy"] += end - start
        self.last_action_end = end
        if kind == "F":
            self._in_flight.add(subnet)
            self.in_flight_max = max(self.in_flight_max, len(self._in_flight))
        elif kind == "U":
            self._in_flight.discard(subnet)
        self._keep(name, kind, start, end)

    def waited(self, seconds: float, end: float) -> None:
        """Blocked ``seconds`` on a neighbour, until ``end``."""
        self.totals["data_wait"] += seconds
        self._wait_in_action += seconds
        self._keep("wait", "wait", end - seconds, end)

    def end_window(self) -> None:
        now = time.perf_counter()
        last = max(self.last_action_end, self._window_start)
        self.totals["drain"] += now - last
        self._keep("drain", "drain", last, now)
        self.windows += 1

    def metrics(self) -> dict[str, float]:
        """Totals so far, in seconds, plus the in-flight depth."""
        busy, wait, drain = self.totals["busy"], self.totals["data_wait"], self.totals["drain"]
        total = busy + wait + drain
        return {"busy_s": busy, "data_wait_s": wait, "drain_s": drain,
                "busy_fraction": busy / total if total else 0.0, "in_flight_max": float(self.in_flight_max)}

    def _keep(self, name: str, kind: str, start: float, end: float) -> None:
        if self.keep_trace:
            self._intervals.append(_Interval(name, kind, start, end))

    def chrome_events(self) -> list[dict[str, Any]]:
        """This stage's intervals as Chrome trace "complete" events (microseconds)."""
        return [
            {"name": i.name, "cat": i.kind, "ph": "X", "pid": self.stage, "tid": 0,
             "ts": (i.start - self._origin) * 1e6, "dur": (i.end - i.start) * 1e6}
            for i in self._intervals
        ]


def write_chrome_trace(path: str | Path, events: Sequence[dict[str, Any]]) -> None:
    """Write a Chrome trace JSON (opens in Perfetto) of all stages' events."""
    names = sorted({e["pid"] for e in events})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"stage {pid}"}} for pid in names]
    Path(path).write_text(json.dumps({"traceEvents": [*meta, *events], "displayTimeUnit": "ms"}))


def write_trace_files(folder: str | Path, events: Sequence[dict[str, Any]]) -> None:
    """``naspipe_trace.json`` and, if matplotlib is installed, ``naspipe_timeline.png`` in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(folder / "naspipe_trace.json", events)
    try:
        plot_timeline(folder / "naspipe_timeline.png", events)
    except ImportError:
        warnings.warn("NASPipe telemetry: install matplotlib to get naspipe_timeline.png next to the trace.")


def plot_timeline(path: str | Path, events: Sequence[dict[str, Any]], seconds: float | None = None) -> None:
    """A PNG timeline of the schedule: one row per stage, F/B/U/wait coloured (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = {"F": "tab:blue", "B": "tab:orange", "U": "tab:green", "wait": "lightgrey", "drain": "silver"}
    stages = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(stages) + 1.2))
    for e in events:
        if seconds is not None and e["ts"] > seconds * 1e6:
            continue
        ax.barh(e["pid"], e["dur"] / 1e3, left=e["ts"] / 1e3, color=colours.get(e["cat"], "black"), height=0.8)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    labels = ["forward", "backward", "update", "waiting for a neighbour", "window drain"]
    ax.legend([Patch(color=c) for c in colours.values()], labels, loc="upper right", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
