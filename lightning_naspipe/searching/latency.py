"""Latency on the device at hand: a lookup table of each candidate's time measured in place (as once-for-all
and nn-Meter build theirs), and the predicted latency of an architecture from it.

Block ``b``'s candidate ``k`` is timed as the block runs in the frozen subnet that takes ``k`` there and candidate 0
everywhere else (``supernet.freeze``: what is deployed, without the supernet's dispatch), on what block ``b``
receives in that subnet (eval mode, no gradients, after warm-up, the median of ``repeats``, the device
synchronised). An architecture's predicted latency is the sum of its blocks' entries.
A block without a choice of its own (a fixed block, or choices nested deeper) has one entry, timed at the
reference subnet. A block whose choices sit deeper (a cell's edge holding its op's :class:`~.choice.ChoiceBlock`,
choices inside an ``nn.Sequential``, elastic layers) has, besides, per label inside it the *delta* of each of the
label's choices: the block timed with that label at ``k``, minus the same subnet timed with it at 0 (0.0 at
``k = 0``), in the subnet nearest the reference that runs it: every other label at 0, unless the label sits in a
layer the reference leaves out (a deeper layer of an ``ElasticDepth``, a candidate or a cell edge not taken), where
the fewest labels are raised that reach it. Its share of a prediction is its entry plus the deltas of the labels it
reads in the architecture (a layer its depth drops reads the shared width no more), an additive model as
once-for-all's and nn-Meter's tables are: it ignores how two labels inside one block interact.

A prediction is only as good as the sum of in-place block times is to the whole subnet's time: :func:`measure_latency`
times an architecture's frozen subnet end to end, and :meth:`LatencyTable.error` reports how far the table's
predictions are from it on a sample of architectures (:class:`LatencyReport`), so users know how far to trust them.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch import nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.space.choice import Architecture, ChoiceBlock
from lightning_naspipe.space.supernet import BlockValue, Supernet
from lightning_naspipe.space.boundary import map_tensors, tensors_in
from lightning_naspipe.searching.latency_report import LatencyReport
from lightning_naspipe.searching.table_passes import (PASSES, Runs, inner_labels, label_contexts, reads,
                                                      reference_choices, timed_pass)
from lightning_naspipe.searching.timing import WARMUP, Clock, relative_spread, time_module, time_modules, warn_if_noisy

__all__ = ["INACCURATE_PCT", "LatencyTable", "at_batch_size", "batch_size_of", "device_name",
           "measure_latency"]

#: A mean absolute prediction error (percent) above which :meth:`LatencyTable.error` warns.
INACCURATE_PCT = 20.0

@dataclass(frozen=True)
class LatencyTable:
    """Each supernet block's candidates' latency in milliseconds on one device and batch size.

    Attributes:
        entries: per block, per candidate of its choice (one entry for a block without a choice of its own).
        labels: per block, the label its entries follow (``None``: one entry).
        device: where it was measured, e.g. ``"cpu"`` or ``"cuda:0"`` (and the GPU's name).
        batch_size: the example input's batch size.
        nested: per block, per label inside it (a block without a label of its own: its nested choices'
            and elastic layers' labels, in first-seen order), ``(label, deltas)``: the latency added by each
            of the label's choices to the block's entry, in ms (``0.0`` at the label's reference choice: its middle one
            for an elastic width several blocks read, else its first; timed where the block runs
            the label, e.g. at the depth that keeps its layer); ``()`` for a block with
            its own label or none inside. ``()`` altogether when no block has deltas (as in tables saved before
            they existed).
    """

    entries: tuple[tuple[float, ...], ...]
    labels: tuple[str | None, ...]
    device: str
    batch_size: int
    nested: tuple[tuple[tuple[str, tuple[float, ...]], ...], ...] = ()
    #: Supernets :meth:`check` accepted (checked once each, not per prediction).
    _checked: weakref.WeakSet[Supernet] = field(default_factory=weakref.WeakSet, init=False, repr=False,
                                                compare=False)

    @classmethod
    def measure(cls, supernet: Supernet, example_input: BlockValue, repeats: int = 10, *,
                clock: Clock = time.perf_counter) -> LatencyTable:
        """Time every candidate of every block in place, on the device of ``supernet``'s parameters.

        Warns when the machine was busy: when the timed runs of a measurement spread by more than
        :data:`~.timing.NOISY_SPREAD` of their median (the median over the table's measurements), naming the spread.

        Args:
            supernet: the search space (not modified: a copy is timed).
            example_input: what the first block receives for one batch, on that device.
            repeats: timed runs per candidate after two warm-up runs; the median is kept. The blocks are timed in
                :data:`~.table_passes.PASSES` passes (at most ``repeats``), each a share of the runs.
            clock: ``clock() -> seconds`` the runs are timed with (a fake one in tests).
        """
        if repeats < 1:
            raise NASPipeConfigError(f"LatencyTable.measure(repeats={repeats}): give at least 1.")
        net = copy.deepcopy(supernet).eval()
        net.local_blocks = None
        device = next(iter(net.parameters()), torch.empty(0)).device
        reference = reference_choices(net)
        labels = tuple(block.label if isinstance(block, ChoiceBlock) else None for block in net.blocks)
        runs: Runs = collections.defaultdict(list)  # in passes over the blocks: see table_passes.py
        contexts = label_contexts(net, reference, labels)
        passes = min(PASSES, repeats)
        with torch.no_grad():
            for p in range(passes):
                share = repeats // passes + (p < repeats % passes)
                timed_pass(net, example_input, reference, labels, contexts, runs, share, WARMUP if p == 0 else 0,
                           device, clock)
        ms = {key: statistics.median(times) for key, times in runs.items()}
        spreads = [relative_spread(times) for times in runs.values()]  # per measurement: the machine's load
        entries = [tuple(ms[(b, None, k)] for k in range(net.labels[label] if label is not None else 1))
                   for b, label in enumerate(labels)]

        def deltas(b: int, inner: str) -> tuple[float, ...]:
            """Each choice of ``inner`` against its reference in block ``b`` (0.0 where no subnet runs it there)."""
            context, choices = contexts[(b, inner)], range(net.labels[inner])
            if context is None:
                return (0.0,) * len(choices)
            return tuple(0.0 if k == context[inner] else ms[(b, inner, k)] - ms[(b, inner, context[inner])]
                         for k in choices)

        nested = [tuple((inner, deltas(b, inner)) for (block, inner) in contexts if block == b)
                  for b in range(len(labels))]
        warn_if_noisy(spreads, "LatencyTable.measure")
        return cls(tuple(entries), labels, device_name(net), batch_size_of(example_input),
                   tuple(nested) if any(nested) else ())

    def predict(self, architecture: Mapping[str, int], supernet: Supernet | None = None) -> float:
        """The predicted latency of ``architecture`` in milliseconds: the sum of its blocks' entries and of the
        nested deltas it picks.

        Args:
            architecture: the subnet. Without ``supernet``, a label it does not reach should be 0 (as in
                ``supernet.canonical(architecture)``, which searchers evaluate), else its delta counts.
            supernet: the table's supernet: the architecture is validated and, where the table has nested deltas,
                a block adds those of the labels it reads in the architecture only (an unreached label, or the
                shared width in the layers an ``ElasticDepth`` drops, contributes nothing).
        """
        if supernet is not None:
            if supernet not in self._checked:  # a table of another space would index out of its rows
                self.check(supernet)
                self._checked.add(supernet)
            architecture = supernet.canonical(architecture) if self.nested else supernet.validate(architecture)
        else:
            self._check_architecture(architecture)
        total = sum(row[architecture[label]] if label is not None else row[0]
                    for row, label in zip(self.entries, self.labels))
        if self.nested:
            for b, block in enumerate(self.nested):
                # With the supernet, a block adds a label's delta only where it reads the label (a layer its
                # ElasticDepth drops reads the shared width no more); without it, wherever the table has it.
                read = reads(supernet, b, architecture) if supernet is not None and block else None
                total += sum(deltas[architecture[label]] for label, deltas in block
                             if read is None or label in read)
        return total

    def _check_architecture(self, architecture: Mapping[str, int]) -> None:
        """Refuse, naming the fix, an architecture that does not fit the table (without a supernet to check it)."""
        counts = {label: len(row) for row, label in zip(self.entries, self.labels) if label is not None}
        counts.update((label, len(deltas)) for block in self.nested for label, deltas in block)
        for label, count in counts.items():
            value = architecture.get(label) if isinstance(architecture, Mapping) else None
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
                raise NASPipeConfigError(
                    f"LatencyTable.predict: the architecture's choice for label {label!r} is "
                    f"{'missing' if value is None else repr(value)}, but this table has {count} candidates there "
                    f"(0 to {count - 1}): the architecture is not of the table's space. Pass the table's supernet, "
                    "table.predict(architecture, model.supernet), to have it validated and canonicalised.")

    def fastest_ms(self) -> float:
        """A lower bound of every prediction: each block's fastest entry, plus each nested label's smallest delta
        (reached only when those choices can be taken together)."""
        return self._bound(min)

    def slowest_ms(self) -> float:
        """An upper bound of every prediction: each block's slowest entry, plus each nested label's largest delta
        (reached only when those choices can be taken together)."""
        return self._bound(max)

    def _bound(self, pick: Callable[[Sequence[float]], float]) -> float:
        """Entries and deltas added in :meth:`predict`'s order, so the bound holds in floating point too."""
        total = sum(pick(row) for row in self.entries)
        if self.nested:
            total += sum(pick(deltas) for block in self.nested for _, deltas in block)
        return total

    def error(self, supernet: Supernet, example_input: BlockValue,
              architectures: Sequence[Mapping[str, int]] | None = None, samples: int = 20, seed: int = 0,
              repeats: int = 10, *, clock: Clock = time.perf_counter) -> LatencyReport:
        """The predictor's error: each architecture's prediction against its frozen subnet timed end to end.

        Warns when the machine was busy (as :meth:`measure` does), and when the mean absolute error exceeds
        :data:`INACCURATE_PCT`, naming ``latency="measured"`` (the search times each architecture end to end).

        Args:
            supernet: the supernet the table was measured on, on the same device.
            example_input: what the first block receives, of the table's batch size.
            architectures: the architectures to compare (default: ``samples`` uniform ones drawn from ``seed``,
                one per canonical form).
            samples: how many to draw when ``architectures`` is not given.
            seed: the draw's seed.
            repeats: timed runs per architecture (as :func:`measure_latency`, but every architecture's runs
                interleaved).
            clock: ``clock() -> seconds`` the runs are timed with (a fake one in tests).
        """
        self.check(supernet)
        if architectures is None:
            drawn: dict[tuple[tuple[str, int], ...], Architecture] = {}
            for i in range(samples):
                a = supernet.canonical(uniform_architecture(supernet.labels, seed, i))
                drawn.setdefault(tuple(sorted(a.items())), a)
            architectures = list(drawn.values())
        if not architectures:
            raise NASPipeConfigError("LatencyTable.error needs at least one architecture (samples >= 1).")
        spreads: list[float] = []
        # Every subnet's runs interleaved (one of each in turn): a slow spell of the machine then slows them all a
        # little, where timing them one after another shifted the subnets it hit alone.
        measured = time_modules([(supernet.freeze(a), example_input) for a in architectures], repeats, clock=clock,
                                spreads=spreads)
        rows = tuple((dict(a), self.predict(a, supernet), ms) for a, ms in zip(architectures, measured))
        warn_if_noisy(spreads, "LatencyTable.error")
        report = LatencyReport(rows, self.device, self.batch_size)
        if report.mean_abs_pct > INACCURATE_PCT:
            warnings.warn(
                f"LatencyTable.error: the table's predictions are off by {report.mean_abs_pct:.1f}% on average "
                f"(above {INACCURATE_PCT:.0f}%) against end-to-end latency on {len(rows)} architectures: the sum of "
                "in-place block times does not model this device well. Search with "
                'lnp.Constraints(latency="measured") to time each architecture end to end instead.', stacklevel=2)
        return report

    def check(self, supernet: Supernet) -> None:
        """Refuse a table measured on another supernet (other blocks, labels or candidate counts, or other labels
        nested in its blocks; a table without nested deltas is checked on its entries only)."""
        labels = tuple(block.label if isinstance(block, ChoiceBlock) else None for block in supernet.blocks)
        counts = tuple(supernet.labels[label] if label is not None else 1 for label in labels)
        nested = tuple(tuple((inner, supernet.labels[inner]) for inner in inner_labels(block)) if label is None
                       else () for block, label in zip(supernet.blocks, labels))
        measured = tuple(tuple((inner, len(deltas)) for inner, deltas in block) for block in self.nested)
        if labels != self.labels or counts != tuple(len(row) for row in self.entries) or (
                self.nested and nested != measured):
            raise NASPipeConfigError(
                "This LatencyTable was measured on another supernet (its blocks' labels or candidate counts differ); "
                "measure it on this one: lnp.LatencyTable.measure(model.supernet, example_input)."
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the table as JSON (with the torch version it was measured under; ``nested`` only when it has
        deltas); the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {"entries": [list(row) for row in self.entries], "labels": list(self.labels),
                                "device": self.device, "batch_size": self.batch_size, "torch": torch.__version__}
        if self.nested:
            data["nested"] = [[[label, list(deltas)] for label, deltas in block] for block in self.nested]
        target.write_text(json.dumps(data, indent=1))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatencyTable:
        """Read a table :meth:`save` wrote (one without ``nested``, as saved before it existed: no deltas)."""
        data = json.loads(Path(path).read_text())
        nested = tuple(tuple((str(label), tuple(float(v) for v in deltas)) for label, deltas in block)
                       for block in data.get("nested", ()))
        return cls(tuple(tuple(float(v) for v in row) for row in data["entries"]), tuple(data["labels"]),
                   str(data["device"]), int(data["batch_size"]), nested)


def measure_latency(supernet: Supernet, architecture: Mapping[str, int], example_input: BlockValue,
                    repeats: int = 10, warmup: int = WARMUP, *, clock: Clock = time.perf_counter,
                    spreads: list[float] | None = None) -> float:
    """The latency of ``architecture`` in milliseconds: its frozen subnet timed end to end.

    The subnet (``supernet.freeze(architecture)``) runs in eval mode without gradients on ``example_input``
    (a fixed shape and batch size), ``warmup`` times untimed and then ``repeats`` times; the median is returned,
    the device synchronised around each run. Measured latency is noisy: the same call twice gives close, not
    equal, numbers.

    Args:
        supernet: the supernet (not modified), holding every block's weights.
        architecture: the subnet to time.
        example_input: what the first block receives for one batch, on the supernet's device.
        repeats: timed runs (at least 1).
        warmup: untimed runs first.
        clock: ``clock() -> seconds`` the runs are timed with.
        spreads: where to append the runs' relative spread (:func:`~.timing.relative_spread`), when given.
    """
    return time_module(supernet.freeze(architecture), example_input, repeats, warmup, clock=clock, spreads=spreads)


def device_name(module: nn.Module) -> str:
    """Where ``module``'s parameters are, e.g. ``"cpu"`` or ``"cuda:0 (NVIDIA H100 ...)"``."""
    device = next(iter(module.parameters()), torch.empty(0)).device
    return str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")


def batch_size_of(value: Any) -> int:
    """The first dimension of the first tensor in ``value`` (1 for a scalar or no tensor)."""
    first = tensors_in(value)
    return int(first[0].shape[0]) if first and first[0].dim() else 1


def at_batch_size(value: Any, size: int) -> Any:
    """``value`` with ``size`` samples: each tensor whose first dimension is ``value``'s batch size
    (:func:`batch_size_of`) cut to its first ``size`` rows, or its rows repeated in order up to ``size``; other
    tensors and values as they are. Timing at another batch size than a table's would not compare with its
    predictions."""
    given = batch_size_of(value)
    if given == size or not tensors_in(value) or tensors_in(value)[0].dim() == 0:
        return value

    def resized(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != given:
            return t
        return t[:size] if given > size else t[torch.arange(size, device=t.device) % given]

    return map_tensors(resized, value)
