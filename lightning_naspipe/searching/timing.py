"""Timing a module on the device at hand, and telling when the timings are unreliable.

Every latency measurement times ``repeats`` runs after a warm-up and keeps their median. The runs' spread says how
busy the machine was: on an idle one they agree closely; under load (other jobs on the cores, a GPU shared) some
runs wait and the spread grows. :func:`warn_if_noisy` warns, naming the spread, when the median over measurements of
their relative spread (interquartile range over median) exceeds :data:`NOISY_SPREAD`. On the CPU, glibc's malloc
is first set to keep freed memory (:func:`~lightning_naspipe.compat.malloc.keep_freed_memory`): with its defaults a
run's megabyte activations are page-faulted in anew each time, at a cost that depends on what ran before.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_naspipe.compat.malloc import keep_freed_memory
from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["NOISY_SPREAD", "WARMUP", "interleaved_times", "relative_spread", "time_module", "time_modules",
           "time_repeats", "warn_if_noisy"]

#: Warm-up runs before the timed ones, everywhere latency is measured.
WARMUP = 2

#: A measurement's relative spread above which the machine counts as busy: 25% (interquartile range over median;
#: the median over a table's or a report's measurements). On an idle machine it stays at a few percent.
NOISY_SPREAD = 0.25

#: ``clock() -> seconds``: what timings are read from (``time.perf_counter``; a test passes a fake one).
Clock = Callable[[], float]


def time_repeats(module: nn.Module, example_input: Any, repeats: int = 10, warmup: int = WARMUP,
                 device: torch.device | None = None, clock: Clock = time.perf_counter) -> list[float]:
    """Each timed run of ``module(example_input)`` in milliseconds (eval mode, no gradients, ``device``
    synchronised: by default that of the module's parameters); the module's mode is restored. On the CPU, malloc
    keeps freed memory from then on (:func:`~lightning_naspipe.compat.malloc.keep_freed_memory`)."""
    _check_counts(repeats, warmup)
    if device is None:
        device = next(iter(module.parameters()), torch.empty(0)).device
    if device.type == "cpu":
        keep_freed_memory()
    was_training = module.training
    module.eval()
    times = []
    try:
        with torch.no_grad():
            for run in range(warmup + repeats):
                _synchronize(device)
                start = clock()
                module(example_input)
                _synchronize(device)
                if run >= warmup:
                    times.append(1000 * (clock() - start))
    finally:
        module.train(was_training)
    return times


def time_module(module: nn.Module, example_input: Any, repeats: int = 10, warmup: int = WARMUP,
                device: torch.device | None = None, clock: Clock = time.perf_counter,
                spreads: list[float] | None = None) -> float:
    """The median latency of ``module(example_input)`` in milliseconds (see :func:`time_repeats`); the runs'
    :func:`relative_spread` is appended to ``spreads`` when given."""
    return time_modules([(module, example_input)], repeats, warmup, device, clock, spreads)[0]


def time_modules(runs: Sequence[tuple[nn.Module, Any]], repeats: int = 10, warmup: int = WARMUP,
                 device: torch.device | None = None, clock: Clock = time.perf_counter,
                 spreads: list[float] | None = None) -> list[float]:
    """The median latency of each ``module(example_input)`` of ``runs`` in milliseconds, as :func:`time_module`, but
    their runs interleaved (one of each in turn): on a machine whose speed drifts (another job, a throttled core), a
    slow spell then slows all of them alike, so their differences, which a latency table's deltas are, hold."""
    times = interleaved_times(runs, repeats, warmup, device, clock)
    if spreads is not None:
        spreads += [relative_spread(t) for t in times]
    return [statistics.median(t) for t in times]


def interleaved_times(runs: Sequence[tuple[nn.Module, Any]], repeats: int = 10, warmup: int = WARMUP,
                      device: torch.device | None = None, clock: Clock = time.perf_counter) -> list[list[float]]:
    """Each timed run of each of ``runs``, in milliseconds, their runs interleaved (:func:`time_modules`)."""
    _check_counts(repeats, warmup)
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(warmup + repeats):
        for i, (module, example_input) in enumerate(runs):
            ran = time_repeats(module, example_input, 1, 0, device, clock)
            if round_ >= warmup:
                times[i] += ran
    return times


def relative_spread(times: Sequence[float]) -> float:
    """The interquartile range of ``times`` over their median (0.0 for fewer than 2 runs or a zero median)."""
    median = statistics.median(times) if times else 0.0
    if len(times) < 2 or median <= 0:
        return 0.0
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")
    return (high - low) / median


def warn_if_noisy(spreads: Sequence[float], what: str) -> float:
    """Warn when the median of ``spreads`` (per measurement, :func:`relative_spread`) exceeds :data:`NOISY_SPREAD`,
    naming it; the median (0.0 without measurements)."""
    spread = statistics.median(spreads) if spreads else 0.0
    if spread > NOISY_SPREAD:
        warnings.warn(
            f"{what}: the timed runs spread by {100 * spread:.0f}% of their median (interquartile range, the median "
            f"over {len(spreads)} measurements; an idle machine stays under {100 * NOISY_SPREAD:.0f}%): the machine "
            "is busy and timings taken under load are unreliable. Measure again with the machine idle (other jobs "
            "stopped, the threads fixed), or with more repeats.", stacklevel=3)
    return spread


def _check_counts(repeats: int, warmup: int) -> None:
    if repeats < 1 or warmup < 0:
        raise NASPipeConfigError(f"Timing a module with repeats={repeats}, warmup={warmup}: give repeats >= 1 and "
                                 "warmup >= 0.")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
