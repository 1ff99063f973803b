"""``lnp.search``: evaluate architectures of a trained supernet and find the best.

Evaluation is architecture-parallel: after fit every stage process holds all weights, so each
process evaluates its share of a round's architectures on its own, whole (no traffic between
stages until the scores are gathered), and every process ends with the same records. Each
architecture's score is computed by the same code on the same batches wherever it runs, so the
history, the scores and the winner do not depend on the number of stages.

One architecture is scored on a :meth:`Supernet.freeze <.supernet.Supernet.freeze>` copy, in eval
mode, after optional BatchNorm recalibration, so the trained supernet is never changed.
Architectures with one :meth:`canonical form <.supernet.Supernet.canonical>` freeze to the same
subnet, so one evaluation scores all of them, whatever a searcher proposes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from lightning_naspipe.transport.boundary import map_tensors, tensors_in
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.transport.distributed import broadcast_object, gather_objects
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.freezing import recalibrate_batchnorm
from lightning_naspipe.searching.latency import LatencyTable
from lightning_naspipe.searching.search_log import append_log, fingerprint, read_log
from lightning_naspipe.searching.search_plot import pareto_front, plot_search
from lightning_naspipe.searching.searchers import Record, Searcher, SearchSpace, architecture_key, ranking_key
from lightning_naspipe.space.supernet import Supernet, supernet_of

__all__ = ["SearchResult", "search"]

#: ``constraint(architecture, params, flops) -> bool``.
Constraint = Callable[[Architecture, int, int], bool]


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` found; the same on every process.

    Attributes:
        history: every evaluated architecture, in evaluation order.
        maximize: whether higher scores are better.
    """

    history: list[Record]
    maximize: bool

    @property
    def best_record(self) -> Record:
        """The best record; equal scores: the earlier evaluation."""
        return min(self.history, key=lambda r: ranking_key(r, self.maximize))

    @property
    def best(self) -> Architecture:
        """The best architecture."""
        return dict(self.best_record.architecture)

    def pareto_front(self) -> list[Record]:
        """The records no other beats on both FLOPs and score, by increasing FLOPs."""
        return pareto_front(self.history, self.maximize)

    def plot(self, path: str | os.PathLike[str], title: str | None = None) -> Path:
        """Write a PNG of score against FLOPs with the Pareto front (needs matplotlib)."""
        return plot_search(self.history, self.maximize, path, title)

    def table(self) -> str:
        """Every record, best first: rank, index, score, params, FLOPs and the architecture."""
        rows = sorted(self.history, key=lambda r: ranking_key(r, self.maximize))
        lines = [f"{'rank':>4} {'index':>5} {'score':>12} {'params':>10} {'MFLOPs':>10}  architecture"]
        lines += [f"{n:>4} {r.index:>5} {r.score:>12.6g} {r.params:>10} {r.flops / 1e6:>10.3f}  "
                  f"{json.dumps(r.architecture)}" for n, r in enumerate(rows, 1)]
        return "\n".join(lines)


def search(trainer: Any, model: Any, searcher: Searcher, dataloader: Iterable[Any], *,
           calibration: Iterable[Any] | None = None, max_params: int | None = None, max_flops: int | None = None,
           constraint: Constraint | None = None, log_path: str | os.PathLike[str] | None = None,
           latency: LatencyTable | None = None, max_latency_ms: float | None = None) -> SearchResult:
    """Search the trained supernet of ``model``; call it on every process, like ``trainer.validate``.

    The score of an architecture is ``sum(value) / sum(weight)`` over ``dataloader``'s batches, with
    ``(value, weight) = model.search_metric(output, batch)`` if the module defines it (e.g. correct and
    total counts: integers sum exactly; higher is better unless ``model.search_higher_is_better`` is
    False), else ``(model.compute_loss(output, batch), 1)``: the mean loss, lower is better.

    Args:
        trainer: the Trainer that trained ``model`` (its processes evaluate in parallel; its loggers
            get ``search/score`` and ``search/best_score`` per evaluation; its progress bar setting is
            followed), or ``None``. A multi-stage ``NASPipeStrategy`` must have launched its processes
            (``fit`` or ``validate`` ran in this script), else the search is refused.
        model: a LightningModule with :class:`~lightning_naspipe.NASPipeMixin`.
        searcher: e.g. :class:`~lightning_naspipe.RandomSearch` or :class:`~lightning_naspipe.EvolutionSearch`.
        dataloader: the evaluation batches (read once, on the first process, and shared).
        calibration: batches to recompute each candidate's BatchNorm statistics on (the same batches for
            every candidate); ``None`` keeps the supernet's statistics.
        max_params: only architectures with at most this many parameters.
        max_flops: only architectures with at most this many FLOPs per sample (see :class:`Record`).
        constraint: ``constraint(architecture, params, flops) -> bool``: a further constraint.
        log_path: a JSON-lines file of the records; if it exists the search resumes from it, evaluating
            nothing twice (it must come from the same searcher, seed and checkpoint).
        latency: a :class:`~lightning_naspipe.LatencyTable` of this supernet on the target device.
        max_latency_ms: with ``latency``, only architectures whose predicted latency is at most this; a budget no
            architecture can meet is refused before any evaluation.

    Returns:
        :class:`SearchResult` with ``.best`` and ``.history``.

    Raises:
        NASPipeConfigError: e.g. the trainer's stage processes were never launched, the dataloader is
            empty, or no architecture meets the constraints.
    """
    _check_launched(trainer)
    supernet = supernet_of(model)
    constraint = _with_latency(supernet, constraint, latency, max_latency_ms)
    device = next(iter(supernet.parameters()), torch.empty(0)).device
    # Reading data loaders draws from the global RNG (their base seed): training after a search
    # must go on as if there had been none.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _search(trainer, model, supernet, device, searcher, dataloader, calibration, max_params, max_flops,
                       constraint, log_path)


def _with_latency(supernet: Supernet, constraint: Constraint | None, latency: LatencyTable | None,
                  max_latency_ms: float | None) -> Constraint | None:
    """``constraint`` and the latency budget, as one constraint; an impossible budget is refused here."""
    if max_latency_ms is None:
        return constraint
    if latency is None:
        raise NASPipeConfigError("search(max_latency_ms=...) needs latency=lnp.LatencyTable.measure(...) (or .load) "
                                 "to predict each architecture's latency.")
    latency.check(supernet)
    if latency.fastest_ms() > max_latency_ms:
        raise NASPipeConfigError(
            f"search(max_latency_ms={max_latency_ms}): no architecture can meet it: the fastest predicted is "
            f"{latency.fastest_ms():.3f} ms on {latency.device} at batch size {latency.batch_size}. Raise the budget.")

    def within(architecture: Architecture, params: int, flops: int) -> bool:
        return latency.predict(architecture) <= max_latency_ms and (
            constraint is None or bool(constraint(architecture, params, flops)))

    return within


def _search(trainer: Any, model: Any, supernet: Supernet, device: torch.device, searcher: Searcher,
            dataloader: Iterable[Any], calibration: Iterable[Any] | None, max_params: int | None,
            max_flops: int | None, constraint: Constraint | None,
            log_path: str | os.PathLike[str] | None) -> SearchResult:
    world, rank = _world()
    batches = _shared(dataloader, rank, world, device)
    if not batches:
        raise NASPipeConfigError("search got an empty dataloader; pass the batches to score architectures on.")
    calibration_batches = _shared(calibration, rank, world, device) if calibration is not None else []
    metric = getattr(model, "search_metric", None)
    maximize = bool(getattr(model, "search_higher_is_better", True)) if metric is not None else False
    score = _Scorer(model, supernet, batches, calibration_batches, metric)
    # What the scores depend on besides the architecture: a log written for anything else is refused.
    key = None if log_path is None else fingerprint(supernet, batches, calibration_batches, searcher, max_params,
                                                     max_flops, constraint, metric is not None)
    logged = read_log(log_path, key, repair=rank == 0) if log_path is not None else []
    history: list[Record] = []
    # Each canonical architecture's (score, params, FLOPs), evaluated once.
    scores: dict[tuple[tuple[str, int], ...], tuple[float, int, int]] = {}
    constrained = max_params is not None or max_flops is not None or constraint is not None
    progress = _progress(trainer, rank)
    try:
        def feasible(architecture: Architecture) -> bool:
            if not constrained:  # measured where evaluated, not on every process
                return True
            params, flops = score.measure(architecture)
            return ((max_params is None or params <= max_params) and (max_flops is None or flops <= max_flops)
                    and (constraint is None or bool(constraint(architecture, params, flops))))

        while proposals := searcher.propose(score.space, history, feasible, maximize):
            first = len(history)
            for i, architecture in enumerate(proposals[:max(0, len(logged) - first)], first):
                if logged[i].architecture != supernet.validate(architecture):
                    raise NASPipeConfigError(
                        f"The search log {log_path} holds {logged[i].architecture} at index {i}, but this search "
                        f"proposes {architecture}: it comes from another searcher, seed or checkpoint. Pass "
                        "another log_path, or the same settings."
                    )
                scores.setdefault(score.key(architecture), (logged[i].score, logged[i].params, logged[i].flops))
            todo = list({score.key(a): a for a in proposals if score.key(a) not in scores}.values())
            mine = {score.key(a): score(a) for a in todo[rank::world]}
            for part in gather_objects(mine, world):
                scores.update(part)
            new = [Record(i, supernet.validate(a), *scores[score.key(a)]) for i, a in enumerate(proposals, first)]
            history += new
            if rank == 0:
                fresh = [r for r in new if r.index >= len(logged)]
                if log_path is not None:
                    append_log(log_path, fresh, key)
                _log(trainer, history, fresh, maximize)
            progress.update(len(new))
    finally:
        progress.close()
    if not history:
        raise NASPipeConfigError(f"{type(searcher).__name__} proposed no architecture; give it samples or cycles.")
    return SearchResult(history, maximize)


class _Scorer:
    """Scores one architecture, and measures (and caches) its parameters and FLOPs."""

    def __init__(self, model: Any, supernet: Supernet, batches: list[Any], calibration: list[Any],
                 metric: Callable[[Any, Any], tuple[Any, Any]] | None) -> None:
        self.model, self.supernet, self.batches, self.calibration, self.metric = (
            model, supernet, batches, calibration, metric)
        self._measured: dict[tuple[tuple[str, int], ...], tuple[int, int]] = {}
        #: What searchers see: the labels, and which architectures run one subnet.
        self.space = SearchSpace(supernet.labels, supernet.canonical)
        first = tensors_in(model.pipeline_input(batches[0]))
        self.samples = first[0].shape[0] if first and first[0].dim() else 1  # FLOPs are reported per sample

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
            net = self.supernet.freeze(architecture).eval()
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                net(self.model.pipeline_input(self.batches[0]))
            self._measured[key] = (sum(p.numel() for p in net.parameters()),
                                   int(counter.get_total_flops()) // self.samples)
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


def _check_launched(trainer: Any) -> None:
    """Refuse a multi-stage NASPipe trainer whose processes are not running: it would search on this one alone."""
    strategy: Any = getattr(trainer, "strategy", None)
    if not getattr(strategy, "_naspipe_stage_processes", False):  # a StageProcesses (integration.processes)
        return
    stages = strategy.num_processes * strategy.num_nodes
    if stages > 1 and _world()[0] != stages:
        raise NASPipeConfigError(
            f"lnp.search got a Trainer whose NASPipeStrategy runs {stages} stage processes, but they are not "
            "running in this process (no process group): the search would run on this process alone. Call "
            "lnp.search after trainer.fit(...) or trainer.validate(model, dataloaders) in the same script: they "
            "launch the stages, each of which then runs the rest of the script (start_method='popen', the "
            "default). Or use the CLI's search subcommand, or pass a one-device Trainer (or trainer=None) to "
            "search on this process alone, with the same results."
        )


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _shared(batches: Iterable[Any], rank: int, world: int, device: torch.device) -> list[Any]:
    """The batches of the first process, on every process, on ``device``."""
    mine = list(batches) if rank == 0 else None
    if world > 1:
        mine = broadcast_object(mine, 0, device)
    assert mine is not None
    return [map_tensors(lambda t: t.to(device), b) for b in mine]


def _log(trainer: Any, history: list[Record], fresh: list[Record], maximize: bool) -> None:
    for record in fresh:
        best = min(history[:record.index + 1], key=lambda r: ranking_key(r, maximize)).score
        metrics = {"search/score": record.score, "search/best_score": best, "search/params": float(record.params),
                   "search/flops": float(record.flops)}
        for logger in getattr(trainer, "loggers", []):
            logger.log_metrics(metrics, step=record.index)
    for logger in getattr(trainer, "loggers", []):
        logger.save()


def _progress(trainer: Any, rank: int) -> Any:
    enabled = rank == 0 and getattr(trainer, "progress_bar_callback", None) is not None
    return tqdm(desc="Search", unit=" architectures", disable=not enabled, dynamic_ncols=True, leave=True)
