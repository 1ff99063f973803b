"""Timings that know when they are unreliable: a busy machine (a fake clock whose repeats disagree) makes table
building and the error report warn naming the spread, a steady one does not; a table whose predictions are far off
warns naming latency="measured"."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence

import pytest
import torch

import lightning_naspipe as lnp
from lightning_naspipe.searching.timing import relative_spread
from test_latency import _supernet


class _Clock:
    """A fake ``perf_counter``: each timed run (a start and an end reading) lasts the next of ``durations_ms``."""

    def __init__(self, durations_ms: Sequence[float]) -> None:
        self.now, self.started, self.durations = 0.0, False, itertools.cycle(durations_ms)

    def __call__(self) -> float:
        self.started = not self.started
        if not self.started:
            self.now += next(self.durations) / 1000
        return self.now


STEADY = [2.0]
BUSY = [2.0, 2.0, 9.0, 2.0, 14.0, 3.0, 2.0]  # other jobs take the cores now and then


def test_the_spread_is_the_interquartile_range_over_the_median() -> None:
    assert relative_spread([2.0] * 5) == 0.0 and relative_spread([2.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)


def test_building_a_table_on_a_busy_machine_warns_naming_the_spread_and_on_a_steady_one_does_not() -> None:
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"LatencyTable.measure: the timed runs spread by \d+% of their median.*"
                                         r"timings taken under load are unreliable"):
        lnp.LatencyTable.measure(_supernet(), x, repeats=7, clock=_Clock(BUSY))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = lnp.LatencyTable.measure(_supernet(), x, repeats=7, clock=_Clock(STEADY))
    assert all(t == pytest.approx(2.0) for row in table.entries for t in row)  # the clock's time is what is kept


def test_the_error_report_warns_on_a_busy_machine_and_names_measured_latency_when_far_off() -> None:
    supernet, x = _supernet(), torch.randn(8, 4)
    # Every prediction is 8.0 ms; measured end to end each subnet takes 2.0 ms: 300% off.
    far = lnp.LatencyTable(((2.0,), (2.0, 2.0, 2.0), (2.0, 2.0), (2.0,)), (None, "a", "b", None), "cpu", 8)
    with pytest.warns(UserWarning, match=r"off by 300.0% on average.*latency=\"measured\""):
        report = far.error(supernet, x, samples=3, repeats=3, clock=_Clock(STEADY))
    assert report.mean_abs_pct == pytest.approx(300.0)
    with pytest.warns(UserWarning, match=r"LatencyTable.error: the timed runs spread by"):
        close = lnp.LatencyTable(((0.5,), (0.5,) * 3, (0.5,) * 2, (0.5,)), far.labels, "cpu", 8)
        close.error(supernet, x, samples=3, repeats=7, clock=_Clock(BUSY))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steady = close.error(supernet, x, samples=3, repeats=3, clock=_Clock(STEADY))
    assert steady.mean_abs_pct == pytest.approx(0.0, abs=1e-9)


def test_timing_modules_together_interleaves_their_runs_so_a_slow_spell_slows_them_alike() -> None:
    from lightning_naspipe.searching.timing import time_modules

    order: list[str] = []

    class Named(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            order.append(self.name)
            return x

    x = torch.zeros(1)
    # The machine slows down 5x for the last 4 of 8 runs: one after the other, b would time 5x a; interleaved, alike.
    spell = [1.0] * 4 + [5.0] * 4
    runs = [(Named("a"), x), (Named("b"), x)]
    assert time_modules(runs, repeats=4, warmup=0, clock=_Clock(spell)) == pytest.approx([3.0, 3.0])
    assert order == ["a", "b"] * 4
    order.clear()
    spreads: list[float] = []
    assert time_modules(runs, repeats=3, warmup=1, clock=_Clock(STEADY), spreads=spreads) == pytest.approx([2.0, 2.0])
    assert order == ["a", "b"] * 4 and spreads == [0.0, 0.0]  # the warm-up round untimed, one spread per module


def test_the_error_report_times_its_subnets_interleaved_so_a_slow_spell_hits_them_alike() -> None:
    """The end-to-end side of ``table.error``: two subnets of the same cost, the machine 5x slower for the second half
    of the runs. One after the other, the second would measure 5x the first and the table look 80% off on it."""
    supernet = _supernet()
    x = torch.randn(8, 4)
    table = lnp.LatencyTable.measure(supernet, x, repeats=3, clock=_Clock(STEADY))
    archs = [{label: 0 for label in supernet.labels}] * 2
    report = table.error(supernet, x, architectures=archs, repeats=4, clock=_Clock([1.0] * 8 + [5.0] * 8))
    # Warm-up (2 rounds) and 2 timed rounds at 1 ms, then 2 at 5 ms: each subnet [1, 1, 5, 5], median 3.
    assert [ms for _, _, ms in report.rows] == pytest.approx([3.0, 3.0])
