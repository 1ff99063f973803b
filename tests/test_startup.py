"""A run's start-up measurements: paid once (the cache serves reruns and resumes), shared by the ranks, logged."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.integration import startup
from lightning_naspipe.integration.profile_cache import ENV
from lightning_naspipe.integration.startup import StartupMeasures
from lightning_naspipe.planning.profile import profile_share, spec_of

MICRO = torch.randn(4, 3, 8, 8)


def _net() -> lnp.Supernet:
    return lnp.Supernet(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)),
                        lnp.ChoiceBlock([nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 5, padding=2), nn.ReLU()]),
                        nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 2)))


def _alone(net: lnp.Supernet) -> StartupMeasures:
    """One rank's measurements, as a run of one process makes them (collectives of one)."""
    return StartupMeasures(net, torch.device("cpu"), 0, 1, lambda value: [value], lambda value: value)


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The shares profiled (each call's ``share``), counted."""
    calls: list[tuple[int, int]] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["share"])
        return profile_share(*args, **kwargs)

    monkeypatch.setattr(startup, "profile_share", counted)
    return calls


def test_a_rerun_loads_the_profile_from_the_cache(profiles: list[tuple[int, int]]) -> None:
    net = _net()
    first = _alone(net)
    spec = first.profile(MICRO, deferred=False)
    assert profiles == [(0, 1)] and first.costs["profile"][1] == "measured"
    assert first.profile(MICRO, deferred=False) is spec and len(profiles) == 1  # this run's, held
    rerun = _alone(_net())  # a new process: the same space, fresh weights
    assert rerun.profile(MICRO, deferred=False) == spec
    assert len(profiles) == 1 and rerun.costs["profile"][1] == "from the cache"
    assert "profile 0.0 s, from the cache" in (rerun.report() or "")
    # Another micro-batch shape is another measurement.
    _alone(net).profile(torch.randn(2, 3, 8, 8), deferred=False)
    assert len(profiles) == 2


def test_an_entry_without_the_deferred_passes_is_measured_again_with_them(profiles: list[tuple[int, int]]) -> None:
    _alone(_net()).profile(MICRO, deferred=False)
    spec = _alone(_net()).profile(MICRO, deferred=True)
    assert len(profiles) == 2 and all(c.deferred_ms is not None for b in spec.blocks for c in b.candidates)
    assert _alone(_net()).profile(MICRO, deferred=False) == spec and len(profiles) == 2  # serves both now


def test_the_split_takes_the_profiles_weights_else_the_cache_else_times(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int]] = []

    def timing(*args: Any, **kwargs: Any) -> list[float]:
        timed.append(kwargs["share"])
        return [0.5, 1.0, 0.25]

    monkeypatch.setattr(startup, "agreed_timed_weights", timing)
    measures = _alone(_net())
    assert measures.split_weights(MICRO) == [0.5, 1.0, 0.25] and timed == [(0, 1)]
    assert measures.costs["timed split"][1] == "measured"
    assert _alone(_net()).split_weights(MICRO) == [0.5, 1.0, 0.25] and len(timed) == 1  # from the cache
    spec = measures.profile(MICRO, deferred=False)
    weights = [b.cost_ms / 1000 for b in spec.blocks]
    assert measures.split_weights(MICRO) == weights and measures.costs["timed split"][1] == "from the profile"
    assert _alone(_net()).split_weights(MICRO) == weights and len(timed) == 1  # the cached profile's, first


def test_without_a_cache_every_run_measures_and_nothing_is_written(profiles: list[tuple[int, int]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = Path(os.environ[ENV])
    monkeypatch.setenv(ENV, "0")
    measures = _alone(_net())
    measures.profile(MICRO, deferred=False)
    measures.profile(MICRO, deferred=False)
    _alone(_net()).profile(MICRO, deferred=False)
    assert len(profiles) == 2 and list(folder.iterdir()) == []
    assert (measures.report() or "").endswith("cache: off)")


def test_a_stale_entry_for_another_space_is_measured_again(profiles: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _alone(_net()).profile(MICRO, deferred=False)
    path = next(Path(os.environ[ENV]).iterdir())
    entry = json.loads(path.read_text())
    entry["value"]["blocks"][1]["candidates"].pop()  # a valid profile of a space with 2 candidates there
    path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="not the supernet's"):
        _alone(_net()).profile(MICRO, deferred=False)
    assert len(profiles) == 2


def test_every_rank_profiles_a_share_and_joins_every_ranks_parts() -> None:
    net = _net()
    other = profile_share(net, MICRO, deferred=False, share=(1, 2), engine_overhead=True)  # rank 1's part
    sent: list[Any] = []

    def gather(value: Any) -> list[Any]:
        sent.append(value)
        return [value, (other, "")]

    spec = StartupMeasures(net, torch.device("cpu"), 0, 2, gather, lambda value: value).profile(MICRO, False)
    mine = sent[0][0]
    assert mine.action_overhead_ms is None  # the last rank times the engine
    assert [len(k) for k in mine.times.forward[1]] == [1, 0, 1]  # paths 0 and 2 of 3
    assert [len(k) for k in other.times.forward[1]] == [0, 1, 0]
    assert spec == spec_of(net, [mine, other]) and spec.action_overhead_ms == other.action_overhead_ms


def test_a_block_that_fails_on_any_rank_fails_every_rank_naming_the_fix() -> None:
    measures = StartupMeasures(_net(), torch.device("cpu"), 0, 2,
                               lambda value: [value, (None, "Profiling block 1 failed (RuntimeError: boom)")],
                               lambda value: value)
    with pytest.raises(lnp.NASPipeConfigError, match="block 1 failed"):
        measures.profile(MICRO, deferred=False)
    with pytest.raises(lnp.NASPipeConfigError, match="Profiling block 0 failed.*num_stages=<int>"):
        _alone(_net()).profile(torch.randn(4, 5), deferred=False)  # not an image


def test_the_report_names_each_part_once() -> None:
    measures = _alone(_net())
    assert measures.report() is None
    measures.record("profile", 0.91, "measured")
    measures.record("layout rebuild", 0.3)
    report = measures.report()
    assert report is not None and report.startswith("NASPipe: setup took 1.2 s (profile 0.9 s, measured; "
                                                    "layout rebuild 0.3 s; cache: ")
    assert measures.report() is None


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
def test_a_rerun_of_num_stages_auto_takes_the_profile_from_the_cache(tmp_path: Path) -> None:
    """Two processes profile a share each on the first run and rank 0 stores the profile; the rerun (a resume
    alike) reads it, profiles nothing and chooses the same layout. Both log what setup cost."""
    from test_pipeline import _launch

    args = ("--devices", "2", "--num-stages", "auto", "--window", "4", "--chunks", "4")
    first = _launch(tmp_path, *args, keep_stderr=True)
    rerun = _launch(tmp_path, *args, name="rerun", keep_stderr=True)
    assert re.search(r"NASPipe: setup took [\d.]+ s \(profile [\d.]+ s, measured", first), first[-3000:]
    assert re.search(r"NASPipe: setup took [\d.]+ s \(profile [\d.]+ s, from the cache", rerun), rerun[-3000:]
    chose = [re.findall(r"num_stages='auto' chose .*", text) for text in (first, rerun)]
    assert chose[0] and chose[0] == chose[1]
    assert [p.name.split("-")[0] for p in Path(os.environ[ENV]).iterdir()] == ["profile"]
