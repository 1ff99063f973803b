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

Constraints (:class:`~.constraints.Constraints`) are hard filters applied before an architecture is evaluated
(a parameter, FLOP or latency range no architecture of the space can meet is refused before anything is
drawn or evaluated, naming the space's bound: :mod:`.bounds`) and an optional soft latency penalty
applied to each score. Under a table every process predicts the same latency; under measured latency the first
process measures, the others take its number, and the log keeps every measurement for a resumed search.

A checked winner: a table's prediction is a sum of block times, which can miss the whole subnet's time. Under a table
and a latency maximum, once the searcher is done, the best architectures are timed end to end in ranking order (as
measured latency is: on the first process, shared, logged) until one measures within ``max_latency_ms`` plus
:attr:`~.constraints.Constraints.check_margin`; that one is the best. Those measured over are kept in the history,
marked :attr:`~.searchers.Record.over_budget`, and named in a warning; at most
:attr:`~.constraints.Constraints.check_top` are measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.bounds import refuse_impossible
from lightning_naspipe.searching.constraints import Constraints
from lightning_naspipe.searching.latency import LatencyTable, device_name
from lightning_naspipe.searching.scoring import LatencySource, Scorer as _Scorer
from lightning_naspipe.searching.search_log import append_log, fingerprint, read_log
from lightning_naspipe.searching.search_plot import default_x, pareto_front, plot_search
from lightning_naspipe.searching.searchers import Key, Record, Searcher, best_of, ranking_key
from lightning_naspipe.searching.timing import warn_if_noisy
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import Supernet, supernet_of
from lightning_naspipe.space.boundary import map_tensors
from lightning_naspipe.transport.distributed import broadcast_object, gather_objects

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
        """The best record (by :attr:`Record.ranked_score`: penalized under a penalty); equal: the earlier one. Never
        one measured over the latency budget (:attr:`Record.over_budget`)."""
        best = best_of(self.history, self.maximize)
        if best is None:
            if not self.history:
                raise ValueError("this SearchResult has no records")
            raise NASPipeConfigError("Every record of this search result measured over its latency budget: none is "
                                     "the best.")
        return best

    @property
    def best(self) -> Architecture:
        """The best architecture."""
        return dict(self.best_record.architecture)

    def pareto_front(self, x: str | None = None, y: str = "score") -> list[Record]:
        """The records no other beats on both ``x`` and ``y`` (``x`` default: latency when every record has one,
        else FLOPs; see :func:`~.search_plot.pareto_front`)."""
        return pareto_front(self.history, self.maximize, default_x(self.history) if x is None else x, y)

    def plot(self, path: str | os.PathLike[str], title: str | None = None, x: str | None = None,
             y: str = "score") -> Path:
        """Write a PNG of ``y`` against ``x`` with the Pareto front (needs matplotlib)."""
        return plot_search(self.history, self.maximize, path, title, x, y)

    def table(self) -> str:
        """Every record, best first: rank, index, score (and penalized score), params, FLOPs, latency (and the
        latency measured end to end, where a budgeted search checked it) and the architecture. A record measured
        over the budget keeps its place by score but no rank (``-``): it is not the best."""
        rows = sorted(self.history, key=lambda r: ranking_key(r, self.maximize))
        latency = any(r.latency_ms is not None for r in self.history)
        checked = any(r.measured_latency_ms is not None for r in self.history)
        penalized = any(r.penalized_score is not None for r in self.history)
        lines = [f"{'rank':>4} {'index':>5} {'score':>12}" + (f" {'penalized':>12}" if penalized else "")
                 + f" {'params':>10} {'MFLOPs':>10}" + (f" {'ms':>10}" if latency else "")
                 + (f" {'measured':>10}" if checked else "") + "  architecture"]
        n = 0
        for r in rows:
            n += not r.over_budget
            line = f"{'-' if r.over_budget else n:>4} {r.index:>5} {r.score:>12.6g}"
            line += f" {r.ranked_score:>12.6g}" if penalized else ""
            line += f" {r.params:>10} {r.flops / 1e6:>10.3f}"
            line += (f" {r.latency_ms:>10.4f}" if r.latency_ms is not None else f" {'-':>10}") if latency else ""
            line += (f" {r.measured_latency_ms:>10.4f}" if r.measured_latency_ms is not None else f" {'-':>10}"
                     ) if checked else ""
            lines.append(f"{line}  {json.dumps(r.architecture)}")
        if any(r.over_budget for r in rows):
            lines.append("rank -: measured end to end over the latency budget, never the best")
        return "\n".join(lines)


def search(trainer: Any, model: Any, searcher: Searcher, dataloader: Iterable[Any], *,
           calibration: Iterable[Any] | None = None, max_params: int | None = None, max_flops: int | None = None,
           constraint: Constraint | None = None, log_path: str | os.PathLike[str] | None = None,
           latency: LatencyTable | str | None = None, max_latency_ms: float | None = None,
           constraints: Constraints | None = None) -> SearchResult:
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
        log_path: a JSON-lines file of the records (and of every latency measurement); if it exists the search
            resumes from it, evaluating and measuring nothing twice (it must come from the same searcher, seed,
            checkpoint and constraints).
        latency: a :class:`~lightning_naspipe.LatencyTable` of this supernet on the target device (or its path),
            or ``"measured"``: each record gets its latency.
        max_latency_ms: only architectures whose latency is at most this; with a table, a budget no architecture
            can meet is refused before any evaluation, and the best is checked end to end before it is returned:
            the best architectures are timed in ranking order (on the first evaluation batch's pipeline input, cut
            or repeated to the table's batch size; on the first process, shared, logged) until one measures at most
            ``max_latency_ms * (1 + constraints.check_margin)`` (5% by default), that one the best; those measured
            over stay in the history with :attr:`Record.over_budget` and are named in a warning; at most
            ``constraints.check_top`` (5) are timed, and if none fits the search raises.
        constraints: :class:`~lightning_naspipe.Constraints`: ranges of parameters, FLOPs and latency and a soft
            latency penalty; the keywords above are folded into it (each may be given once).

    Returns:
        :class:`SearchResult` with ``.best`` and ``.history``.

    Raises:
        NASPipeConfigError: e.g. the trainer's stage processes were never launched, the dataloader is
            empty, no architecture meets the constraints, or none of the best ``check_top`` predicted within the
            latency budget measures within it.
    """
    _check_launched(trainer)
    supernet = supernet_of(model)
    limits = _fold(constraints, max_params=max_params, max_flops=max_flops, latency=latency,
                   max_latency_ms=max_latency_ms)
    limits.check(supernet)  # an impossible latency range is refused before any evaluation
    device = next(iter(supernet.parameters()), torch.empty(0)).device
    # Reading data loaders draws from the global RNG (their base seed): training after a search
    # must go on as if there had been none.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _search(trainer, model, supernet, device, searcher, dataloader, calibration, limits, constraint,
                       log_path)


def _fold(constraints: Constraints | None, **given: Any) -> Constraints:
    """``constraints`` with the search's keywords set; a value given both ways, differently, is refused."""
    base = constraints if constraints is not None else Constraints()
    changes = {}
    for name, value in given.items():
        if value is None:
            continue
        held = getattr(base, name)
        if held is not None and held != value:
            raise NASPipeConfigError(f"search({name}=...) and constraints=Constraints({name}=...) are both given, "
                                     "differently; give it once.")
        changes[name] = value
    return dataclasses.replace(base, **changes) if changes else base


def _search(trainer: Any, model: Any, supernet: Supernet, device: torch.device, searcher: Searcher,
            dataloader: Iterable[Any], calibration: Iterable[Any] | None, limits: Constraints,
            constraint: Constraint | None, log_path: str | os.PathLike[str] | None) -> SearchResult:
    world, rank = _world()
    batches = _shared(dataloader, rank, world, device)
    if not batches:
        raise NASPipeConfigError("search got an empty dataloader; pass the batches to score architectures on.")
    calibration_batches = _shared(calibration, rank, world, device) if calibration is not None else []
    metric = getattr(model, "search_metric", None)
    maximize = bool(getattr(model, "search_higher_is_better", True)) if metric is not None else False
    score = _Scorer(model, supernet, batches, calibration_batches, metric)
    # Counted from the space on the first batch, before anything is drawn: an impossible size range is refused.
    refuse_impossible(limits, supernet, model.pipeline_input(batches[0]))
    # What the scores depend on besides the architecture: a log written for anything else is refused. Settings
    # beyond max_params/max_flops join the hash only when given, so logs of searches without them still resume.
    extra = limits.settings() if (limits.latency is not None or limits.min_params is not None
                                  or limits.min_flops is not None) else None
    key = None if log_path is None else fingerprint(supernet, batches, calibration_batches, searcher,
                                                     limits.max_params, limits.max_flops, constraint,
                                                     metric is not None, extra)
    logged = read_log(log_path, key, repair=rank == 0) if log_path is not None else []
    latency_of = LatencySource(limits, supernet, score.space, model.pipeline_input(batches[0]), log_path, key, world,
                               rank, device)
    latency_of.reuse(logged)
    history: list[Record] = []
    # Each canonical architecture's (score, params, FLOPs), evaluated once.
    scores: dict[tuple[tuple[str, int], ...], tuple[float, int, int]] = {}
    sized = limits.bounds_size or constraint is not None
    constrained = sized or limits.bounds_latency
    progress = _progress(trainer, rank)
    try:
        def feasible(architecture: Architecture) -> bool:
            if not constrained:  # measured where evaluated, not on every process
                return True
            predicted = limits.table is not None  # cheap: first; a measurement is not: last
            if predicted and not limits.within(latency_ms=latency_of(architecture)):
                return False
            if sized:
                params, flops = score.measure(architecture)
                if not limits.within(params=params, flops=flops) or (
                        constraint is not None and not bool(constraint(architecture, params, flops))):
                    return False
            return predicted or not limits.bounds_latency or limits.within(latency_ms=latency_of(architecture))

        while proposals := _propose(searcher, score, history, feasible, maximize, limits, constraint):
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
            new = [logged[i] if i < len(logged) else _record(i, supernet.validate(a), scores[score.key(a)], limits,
                                                              latency_of, maximize)
                   for i, a in enumerate(proposals, first)]
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
        if constrained:
            raise NASPipeConfigError(f"{type(searcher).__name__} found no architecture within the constraints "
                                     f"({_describe(limits, constraint)}); widen the ranges.")
        raise NASPipeConfigError(f"{type(searcher).__name__} proposed no architecture; give it samples or cycles.")
    if limits.checks_winner:
        history = _check_best(history, limits, latency_of, maximize, rank)
    return SearchResult(history, maximize)


def _check_best(history: list[Record], limits: Constraints, latency_of: LatencySource, maximize: bool,
                rank: int) -> list[Record]:
    """``history`` with the best records timed end to end, in ranking order, until one measures within the budget
    (at most ``limits.check_top`` subnets): each checked record gets ``measured_latency_ms``, those over also
    ``over_budget`` and a warning (on the first process). The same on every process: the first one measures."""
    table, budget, allowed = limits.table, limits.max_latency_ms, limits.budget_ms
    assert table is not None and budget is not None and allowed is not None
    where = (f"on {device_name(latency_of.supernet)} at batch size {table.batch_size}, with the "
             f"{100 * limits.check_margin:g}% margin: at most {allowed:.4f} ms")
    checked: dict[int, Record] = {}
    subnets: set[Key] = set()
    fits = False
    for record in sorted(history, key=lambda r: ranking_key(r, maximize)):
        key = latency_of.key(record.architecture)
        new = key not in subnets
        if new and len(subnets) == limits.check_top:
            break
        subnets.add(key)
        ms = latency_of.measure(record.architecture)
        fits = ms <= allowed
        checked[record.index] = dataclasses.replace(record, measured_latency_ms=ms, over_budget=not fits)
        if fits:
            break
        if rank == 0 and new:
            warnings.warn(
                f"lnp.search: architecture {record.architecture} (record {record.index}, score {record.score:.6g}) "
                f"was predicted at {record.latency_ms:.4f} ms, within max_latency_ms={budget}, but "
                f"measures {ms:.4f} ms end to end ({where}): it is dropped, not returned as the best.", stacklevel=4)
    if rank == 0:
        warn_if_noisy(latency_of.spreads, "lnp.search's end-to-end check of its best architectures")
    if not fits:
        measured = "; ".join(f"{r.architecture}: predicted {r.latency_ms:.4f} ms, measured "
                             f"{r.measured_latency_ms:.4f} ms" for r in checked.values())
        raise NASPipeConfigError(
            f"lnp.search: none of the {len(subnets)} best architectures predicted within max_latency_ms={budget} "
            f"measures within it end to end ({where}): {measured}. The table under-predicts this device "
            "(table.error(...) tells by how much): search with latency='measured', raise Constraints(check_top=...) "
            "to check more, or rebuild the table. With log_path, the same search again resumes without evaluating or "
            "measuring anything twice.")
    return [checked.get(r.index, r) for r in history]


def _propose(searcher: Searcher, score: _Scorer, history: list[Record], feasible: Callable[[Architecture], bool],
             maximize: bool, limits: Constraints, constraint: Constraint | None) -> list[Architecture]:
    """The searcher's next proposals; a searcher stopped by the constraints names them."""
    try:
        return searcher.propose(score.space, history, feasible, maximize)
    except NASPipeConfigError as error:
        if "constraints" not in str(error):
            raise
        raise NASPipeConfigError(f"{error} The search's constraints: {_describe(limits, constraint)}.") from error


def _describe(limits: Constraints, constraint: Constraint | None) -> str:
    text = limits.describe()
    if constraint is not None:
        text += f"; constraint={getattr(constraint, '__qualname__', repr(constraint))}"
    return text


def _record(index: int, architecture: Architecture, measured: tuple[float, int, int], limits: Constraints,
            latency_of: LatencySource, maximize: bool) -> Record:
    """A new record: the score, sizes, latency (when known) and the penalized score (under a penalty)."""
    value, params, flops = measured
    ms = latency_of(architecture) if limits.latency is not None else None
    penalized = limits.penalty.apply(value, ms, maximize) if limits.penalty is not None and ms is not None else None
    return Record(index, architecture, value, params, flops, ms, limits.latency_kind, penalized)


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
        best = min(history[:record.index + 1], key=lambda r: ranking_key(r, maximize)).ranked_score
        metrics = {"search/score": record.score, "search/best_score": best, "search/params": float(record.params),
                   "search/flops": float(record.flops)}
        if record.latency_ms is not None:
            metrics["search/latency_ms"] = record.latency_ms
        if record.penalized_score is not None:
            metrics["search/penalized_score"] = record.penalized_score
        for logger in getattr(trainer, "loggers", []):
            logger.log_metrics(metrics, step=record.index)
    for logger in getattr(trainer, "loggers", []):
        logger.save()


def _progress(trainer: Any, rank: int) -> Any:
    enabled = rank == 0 and getattr(trainer, "progress_bar_callback", None) is not None
    return tqdm(desc="Search", unit=" architectures", disable=not enabled, dynamic_ncols=True, leave=True)
