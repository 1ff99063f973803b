"""Latency on the device at hand: a lookup table of each candidate's time measured in place (as once-for-all
and nn-Meter build theirs), and the predicted latency of an architecture from it.

Block ``b``'s candidate ``k`` is timed as the block runs in the subnet that takes ``k`` there and candidate 0
everywhere else, on what block ``b`` receives in that subnet (eval mode, no gradients, after warm-up, the median
of ``repeats``, the device synchronised). An architecture's predicted latency is the sum of its blocks' entries.
A block without a choice of its own (a fixed block, or choices nested deeper) has one entry, timed at the
reference subnet.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.choice import ChoiceBlock
from lightning_naspipe.space.supernet import BlockValue, Supernet

__all__ = ["LatencyTable"]


@dataclass(frozen=True)
class LatencyTable:
    """Each supernet block's candidates' latency in milliseconds on one device and batch size.

    Attributes:
        entries: per block, per candidate of its choice (one entry for a block without a choice of its own).
        labels: per block, the label its entries follow (``None``: one entry).
        device: where it was measured, e.g. ``"cpu"`` or ``"cuda:0"`` (and the GPU's name).
        batch_size: the example input's batch size.
    """

    entries: tuple[tuple[float, ...], ...]
    labels: tuple[str | None, ...]
    device: str
    batch_size: int

    @classmethod
    def measure(cls, supernet: Supernet, example_input: BlockValue, repeats: int = 10) -> LatencyTable:
        """Time every candidate of every block in place, on the device of ``supernet``'s parameters.

        Args:
            supernet: the search space (not modified: a copy is timed).
            example_input: what the first block receives for one batch, on that device.
            repeats: timed runs per candidate after two warm-up runs; the median is kept.
        """
        if repeats < 1:
            raise NASPipeConfigError(f"LatencyTable.measure(repeats={repeats}): give at least 1.")
        net = copy.deepcopy(supernet).eval()
        net.local_blocks = None
        device = next(iter(net.parameters()), torch.empty(0)).device
        reference = {label: 0 for label in net.labels}
        labels = tuple(block.label if isinstance(block, ChoiceBlock) else None for block in net.blocks)
        entries: list[tuple[float, ...]] = []
        x: Any = example_input
        with torch.no_grad():
            for b, label in enumerate(labels):
                count = net.labels[label] if label is not None else 1
                entries.append(tuple(_median_ms(net, b, x, {**reference, **({label: k} if label else {})}, repeats,
                                                device) for k in range(count)))
                x = net.run_block(b, x, reference)
        name = str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        return cls(tuple(entries), labels, name, _batch_size(example_input))

    def predict(self, architecture: Mapping[str, int]) -> float:
        """The predicted latency of ``architecture`` in milliseconds: the sum of its blocks' entries."""
        return sum(row[architecture[label]] if label is not None else row[0]
                   for row, label in zip(self.entries, self.labels))

    def fastest_ms(self) -> float:
        """The lowest latency any architecture can be predicted to have (each block's fastest entry)."""
        return sum(min(row) for row in self.entries)

    def check(self, supernet: Supernet) -> None:
        """Refuse a table measured on another supernet (other blocks, labels or candidate counts)."""
        labels = tuple(block.label if isinstance(block, ChoiceBlock) else None for block in supernet.blocks)
        counts = tuple(supernet.labels[label] if label is not None else 1 for label in labels)
        if labels != self.labels or counts != tuple(len(row) for row in self.entries):
            raise NASPipeConfigError(
                "This LatencyTable was measured on another supernet (its blocks' labels or candidate counts differ); "
                "measure it on this one: lnp.LatencyTable.measure(model.supernet, example_input)."
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the table as JSON (with the torch version it was measured under); the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"entries": [list(row) for row in self.entries], "labels": list(self.labels),
                                      "device": self.device, "batch_size": self.batch_size,
                                      "torch": torch.__version__}, indent=1))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatencyTable:
        """Read a table :meth:`save` wrote."""
        data = json.loads(Path(path).read_text())
        return cls(tuple(tuple(float(v) for v in row) for row in data["entries"]), tuple(data["labels"]),
                   str(data["device"]), int(data["batch_size"]))


def _median_ms(net: Supernet, block: int, x: Any, architecture: Mapping[str, int], repeats: int,
               device: torch.device) -> float:
    times = []
    for run in range(repeats + 2):
        _synchronize(device)
        start = time.perf_counter()
        net.run_block(block, x, architecture)
        _synchronize(device)
        if run >= 2:  # two warm-up runs
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, (tuple, list)) and value:
        return _batch_size(value[0])
    if isinstance(value, dict) and value:
        return _batch_size(next(iter(value.values())))
    return 1
