"""What a search measures of one architecture: its score, parameters and FLOPs (:class:`Scorer`), and its latency,
predicted by a table or measured end to end (:class:`LatencySource`).

Measured latency is noisy, so every process must decide on the same number: the first process measures, the others
receive its measurement, and each is appended to the search log as it is taken, so that a resumed search reuses it
rather than measuring again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching import latency as latency_module
from lightning_naspipe.searching.constraints import Constraints, sizes_of
from lightning_naspipe.searching.search_log import append_measurement, read_measurements
from lightning_naspipe.searching.searchers import Key, Record, SearchSpace, architecture_key
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.freezing import recalibrate_batchnorm
from lightning_naspipe.space.supernet import Supernet
from lightning_naspipe.transport.distributed import broadcast_object

__all__ = ["LatencySource", "Scorer"]


class Scorer:
    """Scores one architecture, and measures (and caches) its parameters and FLOPs."""

    def __init__(self, model: Any, supernet: Supernet, batches: list[Any], calibration: list[Any],
                 metric: Callable[[Any, Any], tuple[Any, Any]] | None) -> None:
        self.model, self.supernet, self.batches, self.calibration, self.metric = (
            model, supernet, batches, calibration, metric)
        self._measured: dict[tuple[tuple[str, int], ...], tuple[int, int]] = {}
        #: What searchers see: the labels, and which architectures run one subnet.
        self.space = SearchSpace(supernet.labels, supernet.canonical)
        self.samples = latency_module.batch_size_of(model.pipeline_input(batches[0]))  # FLOPs are per sample

    def key(self, architecture: Architecture) -> tuple[tuple[str, int], ...]:
        """Equal for architectures that run the same subnet (one canonical form), which score the same."""
        return architecture_key(self.space.canonical(architecture))

    def frozen(self, architecture: Architecture) -> nn.Module:
        net = self.supernet.freeze(architecture)
        if self.calibration:
            recalibrate_batchnorm(net, self.calibration, forward=lambda batch: net(self.model.pipeline_input(batch)))
        return net.eval()

    def measure(self, architecture: Architecture) -> tuple[int, int]:
        """Parameters, and FLOPs per sample of the first batch's forward (a constraint's inputs)."""
        key = self.key(architecture)
        if key not in self._measured:
            self._measured[key] = sizes_of(self.supernet.freeze(architecture).eval(),
                                           self.model.pipeline_input(self.batches[0]))
        return self._measured[key]

    def __call__(self, architecture: Architecture) -> tuple[float, int, int]:
        """The score, the parameters and the FLOPs of ``architecture``."""
        net = self.frozen(architecture)
        total, weight = 0.0, 0.0
        counter = FlopCounterMode(display=False)
        with torch.no_grad():
            for n, batch in enumerate(self.batches):
                if n == 0:  # FLOPs counted on the first batch's forward (the mode only counts, results unchanged)
                    with counter:
                        output = net(self.model.pipeline_input(batch))
                else:
                    output = net(self.model.pipeline_input(batch))
                value, count = (self.metric(output, batch) if self.metric is not None
                                else (self.model.compute_loss(output, batch), 1))
                total += _number(value, "value")
                weight += _number(count, "weight")
        if weight == 0:
            raise NASPipeConfigError("search_metric returned a total weight of 0; return (value, count) with "
                                     "count > 0.")
        params = sum(p.numel() for p in net.parameters())
        return total / weight, params, int(counter.get_total_flops()) // self.samples


def _number(value: Any, what: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise NASPipeConfigError(f"search_metric/compute_loss must give a scalar {what}, got shape "
                                     f"{tuple(value.shape)}.")
        return float(value.item())  # float32 -> float64 is exact; sums run in a fixed order
    return float(value)


class LatencySource:
    """Each architecture's latency in ms: predicted by the constraints' table, or measured once per canonical
    architecture (on the first process, shared with the others, logged as it is taken).

    Under a table with a latency maximum, :meth:`measure` also times architectures end to end (the search's check of
    its best), the same way, on the example input cut or repeated to the table's batch size.

    Args:
        constraints: the search's constraints (their ``latency``: a table or ``"measured"``).
        supernet: the supernet.
        space: the search space (which architectures are one subnet).
        example_input: what measured latency is timed on (the search's first batch's pipeline input).
        log_path: the search log, whose measurements are reused and to which new ones are appended.
        log_key: the log's fingerprint.
        world: the number of processes searching.
        rank: this process's.
        device: the device of objects shared between processes.
    """

    def __init__(self, constraints: Constraints, supernet: Supernet, space: SearchSpace, example_input: Any,
                 log_path: str | os.PathLike[str] | None, log_key: str | None, world: int, rank: int,
                 device: torch.device) -> None:
        table = constraints.table
        if table is not None:  # a check's measurement compares with the table's predictions: at its batch size
            example_input = latency_module.at_batch_size(example_input, table.batch_size)
        self.constraints, self.supernet, self.space, self.example_input = constraints, supernet, space, example_input
        self.log_path, self.log_key, self.world, self.rank, self.device = log_path, log_key, world, rank, device
        self.measured: dict[Key, float] = {}
        #: Per measurement taken here (rank 0), its runs' relative spread: how busy the machine was.
        self.spreads: list[float] = []
        if (constraints.measured or constraints.checks_winner) and log_path is not None:
            for architecture, ms in read_measurements(log_path):
                self.measured.setdefault(self.key(architecture), ms)

    def key(self, architecture: Architecture) -> Key:
        """Equal for architectures that run one subnet (measured once)."""
        return architecture_key(self.space.canonical(architecture))

    def reuse(self, records: list[Record]) -> None:
        """Take the measured latency of logged records (a resumed search never measures them again)."""
        for record in records:
            if record.latency_kind == "measured" and record.latency_ms is not None:
                self.measured.setdefault(self.key(record.architecture), record.latency_ms)

    def __call__(self, architecture: Architecture) -> float:
        table = self.constraints.table
        if table is not None:
            return table.predict(architecture, self.supernet)
        return self.measure(architecture)

    def measure(self, architecture: Architecture) -> float:
        """``architecture``'s frozen subnet timed end to end, once per canonical architecture: on the first process,
        its number sent to the others (a collective when several search), logged before anything is decided on it;
        a measurement in the log is reused."""
        key = self.key(architecture)
        if key not in self.measured:
            canonical = self.space.canonical(architecture)
            ms = (latency_module.measure_latency(self.supernet, canonical, self.example_input,
                                                 self.constraints.repeats, spreads=self.spreads)
                  if self.rank == 0 else None)
            if self.world > 1:  # every process decides on the first one's number
                ms = broadcast_object(ms, 0, self.device)
            assert ms is not None
            if self.rank == 0 and self.log_path is not None:
                append_measurement(self.log_path, canonical, ms, self.log_key)
            self.measured[key] = float(ms)
        return self.measured[key]
