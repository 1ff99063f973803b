from __future__ import annotations

import json
import time
from pathlib import Path

import lightning_naspipe as lnp
from helpers import train
from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry, write_trace_files


def test_busy_wait_and_drain_are_separated() -> None:
    tel = StageTelemetry(stage=1, keep_trace=True)
    tel.begin_window()
    t0 = time.perf_counter()
    tel.start_action()
    tel.waited(0.25, t0 + 0.25)  # the forward first waited for its input
    tel.action("F0.0", "F", 0, t0, t0 + 1.0)
    tel.start_action()
    tel.action("F1.0", "F", 1, t0 + 1.0, t0 + 1.5)
    tel.start_action()
    tel.action("U0", "U", 0, t0 + 1.5, t0 + 2.0)
    tel.end_window()
    metrics = tel.metrics()
    assert abs(metrics["busy_s"] - 1.75) < 1e-9 and abs(metrics["data_wait_s"] - 0.25) < 1e-9
    assert metrics["in_flight_max"] == 2.0
    names = [e["name"] for e in tel.chrome_events()]
    assert names[:4] == ["wait", "F0.0", "F1.0", "U0"]


def test_strategy_logs_telemetry_and_writes_a_trace(tmp_path: Path) -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4, trace_dir=str(tmp_path)), max_steps=8)
    metrics = trainer.callback_metrics
    assert metrics["telemetry/busy_s_stage0"] > 0 and metrics["telemetry/in_flight_max_stage0"] == 1
    trace = json.loads((tmp_path / "naspipe_trace.json").read_text())
    kinds = {e.get("cat") for e in trace["traceEvents"]}
    assert {"F", "B", "U"} <= kinds
    assert sum(1 for e in trace["traceEvents"] if e.get("cat") == "U") == 8  # one update per subnet
    assert (tmp_path / "naspipe_timeline.png").stat().st_size > 0


def test_trace_files_from_events(tmp_path: Path) -> None:
    events = [{"name": "F0.0", "cat": "F", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 5.0}]
    write_trace_files(tmp_path, events)
    assert json.loads((tmp_path / "naspipe_trace.json").read_text())["traceEvents"][-1] == events[0]
