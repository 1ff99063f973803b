"""Schedule simulator and planner: predict NASPipe's throughput before running it.

A :class:`~.space_spec.SpaceSpec` describes a search space by costs only (per block, per candidate: forward and
backward milliseconds and whether it holds state), plus the run's overheads. :func:`simulate` samples
subnets like the mixin's default sampler, splits the blocks into stages, builds each window's CSP
schedule with the real scheduler (:func:`~lightning_naspipe.schedule.schedules.build_schedule`), times it with
those costs, and reports throughput, bubbles, why stages stall and how many subnets are in flight.
:func:`plan` does it for many stage counts; it reuses the sampler, the stage split and the schedule
modes of the training code, so predictions cannot drift from what runs. :mod:`.profile` measures a
supernet. See ``docs/planner.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_naspipe.schedule.lookahead import plan_step
from lightning_naspipe.pipeline.placement.partition import balanced_split
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.schedule.actions import BACKWARD, FORWARD, UPDATE, Action, Schedule
from lightning_naspipe.schedule.schedules import SCHEDULES, build_schedule, scheduling_resources
from lightning_naspipe.planning.deferral import deferring, passes
from lightning_naspipe.planning.links import LinkModel, streamed_chain_ms
from lightning_naspipe.planning.nodes import replica_view
from lightning_naspipe.planning.replica_update import replica_update_ms
from lightning_naspipe.planning.stalls import CAUSES, SEND, analyse_stage
from lightning_naspipe.planning.space_spec import SpaceSpec

__all__ = ["TICKS_PER_MS", "Prediction", "best_layout", "fitting_layouts", "plan", "plan_layouts", "simulate", "table"]

#: Simulation clock: 1 tick = 10 µs; every action lasts at least one tick.
TICKS_PER_MS = 100
Resource = tuple[int, int]


@dataclass(frozen=True)
class Prediction:
    """What :func:`simulate` predicts for ``subnets`` subnets. Times are milliseconds.

    Attributes:
        busy_ms: per stage, time spent in actions.
        stalls_ms: per stage, idle time by cause (:data:`CAUSES`); busy + stalls = ``makespan_ms``.
        inflight_max / inflight_mean: per stage, subnets started (first F) but not yet updated
            (U); the mean is time-weighted over the run.
        replicas: data-parallel replicas of the pipeline (each runs ``chunks / replicas`` micro-batches).
    """

    stages: int
    window: int
    chunks: int
    schedule: str
    subnets: int
    balance: tuple[int, ...]
    makespan_ms: float
    busy_ms: tuple[float, ...]
    stalls_ms: tuple[dict[str, float], ...]
    inflight_max: tuple[int, ...]
    inflight_mean: tuple[float, ...]
    batch_size: int | None = None
    replicas: int = 1

    @property
    def layout(self) -> str:
        """``"S x D"``: stages times replicas."""
        return f"{self.stages}x{self.replicas}"

    @property
    def subnets_per_s(self) -> float:
        return 1000.0 * self.subnets / self.makespan_ms if self.makespan_ms else math.inf

    @property
    def samples_per_s(self) -> float | None:
        return None if self.batch_size is None else self.subnets_per_s * self.batch_size

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all stages' time."""
        return 1.0 - sum(self.busy_ms) / (self.stages * self.makespan_ms) if self.makespan_ms else 0.0

    def stall_split(self) -> dict[str, float]:
        """Share of all idle time per cause (sums to 1 when there is idle time)."""
        idle = {cause: sum(s[cause] for s in self.stalls_ms) for cause in CAUSES}
        total = sum(idle.values())
        return {cause: (v / total if total else 0.0) for cause, v in idle.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields plus the derived metrics."""
        return {**asdict(self), "subnets_per_s": self.subnets_per_s, "samples_per_s": self.samples_per_s,
                "bubble_ratio": self.bubble_ratio, "stall_split": self.stall_split()}


def _ticks(ms: float) -> int:
    return max(1, round(ms * TICKS_PER_MS))


def simulate(spec: SpaceSpec, stages: int, window: int, chunks: int = 1, schedule: str = "csp",
             subnets: int | None = None, seed: int = 0, balance: Sequence[int] | None = None,
             architectures: Sequence[Mapping[str, int]] | None = None, batch_size: int | None = None,
             order: str = "engine", lookahead: bool = True, defer_weight_grads: bool | None = None,
             replicas: int = 1, links: LinkModel | None = None, nodes: int | None = None) -> Prediction:
    """Predict a run of ``subnets`` subnets (default: 64, rounded up to whole windows).

    Args:
        spec: the space's costs.
        stages: pipeline stages (at most the number of blocks).
        window: subnets per window; windows run one after another, each drained at its end.
        chunks: micro-batches per subnet; each action costs its share of the subnet's time.
        schedule: ``"csp"``, ``"one_in_flight"``, ``"gpipe"`` or ``"async"``, as the engine's.
        subnets: how many subnets to simulate; ignored when ``architectures`` is given.
        seed: the sampler's seed (the mixin's default uniform sampler).
        balance: blocks per stage; default: balanced by expected forward + backward time per subnet.
        architectures: explicit subnets (dicts label -> candidate) instead of the sampler.
        batch_size: samples per subnet, for :attr:`Prediction.samples_per_s`.
        order: ``"engine"``: each stage runs the engine's action order (the scheduler run with unit
            costs), timed with these costs; ``"greedy"``: the scheduler run with these costs (what
            a cost-aware order would achieve).
        lookahead: as ``NASPipeStrategy(lookahead=...)``: with ``"engine"`` order, ``"csp"`` and several
            stages, each window is planned with the next one's forwards in its drain (:mod:`..lookahead`)
            and the stages run their steps back to back, each pausing for the per-window overheads at
            its own window end, less the batch reading its waits in the window before hid; else windows
            run one after another, each drained at its end.
        defer_weight_grads: as ``NASPipeStrategy(defer_weight_grads=...)``: where a stage defers, a backward
            sends its gradient after the blocks' input-gradient passes and then runs their weight passes
            (the candidates' ``input_backward_ms``/``weight_backward_ms``). ``None`` decides per stage as the
            engine does (:class:`~lightning_naspipe.pipeline.exactness.weight_grads.DeferralChooser`), on the modelled
            times.
        replicas: data-parallel replicas of the pipeline (``NASPipeStrategy(num_stages=stages)`` on
            ``stages * replicas`` processes): each runs its ``chunks / replicas`` micro-batches, each costing
            ``1 / chunks`` of the subnet's time, and every update waits for the replicas' chained reduction.
        links: the links between replicas (:mod:`.links`); default: the spec's ``replica_links``, else its
            one-host message costs.
        nodes: nodes the ``stages * replicas`` processes span, ranks as :class:`.Layout` orders them: stage messages
            and the replicas' reduction take the links between nodes where they cross (:func:`.replica_view`).
    """
    if replicas < 1 or chunks % replicas:
        raise ValueError(f"chunks={chunks} must be a multiple of replicas={replicas}")
    total_chunks, processes = chunks, stages * replicas
    # One replica's pipeline: its share of the micro-batches, each 1/chunks of the compute, placed on the nodes.
    spec, chunks = replica_view(spec, stages, replicas, links, nodes), chunks // replicas
    labels = spec.labels()
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if order not in ("engine", "greedy"):
        raise ValueError(f"order must be 'engine' or 'greedy', got {order!r}")
    if not 1 <= stages <= len(spec.blocks) or window < 1 or chunks < 1:
        raise ValueError(f"need 1 <= stages <= {len(spec.blocks)} blocks, window >= 1 and chunks >= 1")
    if architectures is None:
        count = subnets if subnets is not None else window * -(-64 // window)
        architectures = [uniform_architecture(labels, seed, i) for i in range(count)]
    bad = next((a for a in architectures if any(not 0 <= a.get(k, -1) < n for k, n in labels.items())), None)
    if not architectures or bad is not None:
        raise ValueError(f"need at least one subnet, each choosing a candidate per label {labels}; got {bad}")
    if balance is None:
        balance = balanced_split([max(b.cost_ms, 1e-3) for b in spec.blocks], stages)
    if len(balance) != stages or min(balance) < 1 or sum(balance) != len(spec.blocks):
        raise ValueError(f"balance {list(balance)} must give each of {stages} stages >= 1 block, "
                         f"{len(spec.blocks)} in all")
    bounds = [sum(balance[:s]) for s in range(stages + 1)]
    ranges = [range(bounds[s], bounds[s + 1]) for s in range(stages)]
    run = _rolled if lookahead and stages > 1 and schedule == "csp" and order == "engine" else _run
    defer = None  # one stage, or deferring forced off: no stage defers, and no subnet's resources are needed
    if stages > 1 and replicas == 1 and defer_weight_grads is not False:  # as the engine: never with replicas
        _, res, _ = _subnets(spec, ranges, architectures, chunks, 1.0)
        defer = deferring(spec, ranges, architectures, res, window, chunks, defer_weight_grads)
    pred = run(spec, ranges, architectures, window, chunks, schedule, order, 1.0, batch_size, defer)
    scale = 1.0
    for _ in range(4 if processes > 1 and spec.parallel_slowdown > 1 else 0):
        # Contention: compute is parallel_slowdown x slower while every stage computes, less while some idle.
        span = pred.makespan_ms - pred.stalls_ms[0]["overhead"]
        busy = sum(pred.busy_ms) / (stages * span) if span else 0.0
        scale = (scale + 1 + (spec.parallel_slowdown - 1) * busy) / 2
        pred = run(spec, ranges, architectures, window, chunks, schedule, order, scale, batch_size, defer)
    return replace(pred, chunks=total_chunks, replicas=replicas) if replicas > 1 else pred


def _run(spec: SpaceSpec, ranges: list[range], architectures: Sequence[Mapping[str, int]], window: int, chunks: int,
         schedule: str, order: str, scale: float, batch_size: int | None,
         defer: Sequence[Sequence[bool]] | None = None) -> Prediction:
    """Simulate the windows one after another, compute times scaled by ``scale``."""
    stages = len(ranges)
    total = 0
    busy = [0] * stages
    stalls = [dict.fromkeys(CAUSES, 0) for _ in range(stages)]
    inflight_max, inflight_area = [0] * stages, [0] * stages
    fixed = spec.step_overhead_ms + (spec.sync_ms if stages > 1 else 0.0)
    latency = round(spec.message_ms * TICKS_PER_MS)
    for first in range(0, len(architectures), window):
        archs = architectures[first:first + window]
        costs, res, _ = _subnets(spec, ranges, archs, chunks, scale, defer[first:first + window] if defer else None)
        seen = scheduling_resources(schedule, res)
        if order == "greedy":
            sched = build_schedule(seen, chunks, lambda s, a: costs[a.subnet][s][a.kind], latency=latency)
        else:
            sched, _ = _timed(build_schedule(seen, chunks).stages, costs, latency)
        overhead = round((fixed + len(archs) * spec.subnet_overhead_ms) * TICKS_PER_MS)
        for s in range(stages):
            b, idle, peak, area = analyse_stage(sched, s, seen, chunks, latency, order == "engine",
                                                costs=costs if order == "engine" else None)
            busy[s] += b
            for cause, ticks in idle.items():
                stalls[s][cause] += ticks
            stalls[s]["overhead"] += overhead
            inflight_max[s], inflight_area[s] = max(inflight_max[s], peak), inflight_area[s] + area
        total += sched.makespan + overhead
    ms = 1.0 / TICKS_PER_MS
    return Prediction(stages, window, chunks, schedule, len(architectures), tuple(len(r) for r in ranges), total * ms,
                      tuple(b * ms for b in busy), tuple({c: v * ms for c, v in st.items()} for st in stalls),
                      tuple(inflight_max), tuple(a / total if total else 0.0 for a in inflight_area), batch_size)


def _subnets(spec: SpaceSpec, ranges: list[range], architectures: Sequence[Mapping[str, int]], chunks: int,
             scale: float, defer: Sequence[Sequence[bool]] | None = None,
             ) -> tuple[list[list[dict[str, int]]], list[list[frozenset[Resource]]], list[list[bool]]]:
    """Per subnet and stage: its action costs, its resources (stateful picks) and whether a pick holds buffers;
    ``defer[i][s]``: stage ``s`` defers subnet ``i``'s weight gradients."""
    picks = [[(b, block.pick(arch)) for b, block in enumerate(spec.blocks)] for arch in architectures]
    chosen = [[[picks[i][b] for b in r] for r in ranges] for i in range(len(architectures))]
    costs = [[_stage_costs(spec, stage, chunks, s, len(ranges), scale, bool(defer and defer[i][s]))
              for s, stage in enumerate(per)] for i, per in enumerate(chosen)]
    res = [[frozenset(p for p in stage if spec.blocks[p[0]].candidates[p[1]].stateful) for stage in per]
           for per in chosen]
    buffers = [[any(spec.blocks[b].candidates[k].buffers for b, k in stage) for stage in per] for per in chosen]
    return costs, res, buffers


def _rolled(spec: SpaceSpec, ranges: list[range], architectures: Sequence[Mapping[str, int]], window: int,
            chunks: int, schedule: str, order: str, scale: float, batch_size: int | None,
            defer: Sequence[Sequence[bool]] | None = None) -> Prediction:
    """The engine with lookahead: every window planned as :func:`..lookahead.plan_step` plans it, the
    stages' steps run back to back, and each stage pauses at its own window ends for the overheads."""
    stages, n = len(ranges), len(architectures)
    costs, res, buffers = _subnets(spec, ranges, architectures, chunks, scale, defer)
    orders: list[list[Action]] = [[] for _ in range(stages)]
    pauses: list[dict[int, tuple[int, int]]] = [{} for _ in range(stages)]
    done: frozenset[tuple[int, Action]] = frozenset()
    for first in range(0, n, window):
        size, joint = min(window, n - first), res[first:first + 2 * window]
        def may_run_early(i: int, s: int, first: int = first) -> bool:
            return not buffers[first + i][s]

        step = plan_step(joint, size, chunks, done, may_run_early)
        # Lightning's per-window work, and reading the window's batches: the stages read those while
        # they wait for messages in the window before (WindowLoader.read_ahead).
        pause = (round((spec.step_overhead_ms + spec.sync_ms) * TICKS_PER_MS),
                 round(size * spec.subnet_overhead_ms * TICKS_PER_MS))
        for s, actions in enumerate(step.schedule.stages):
            pauses[s][len(orders[s])] = pause
            orders[s] += [Action(a.kind, first + a.subnet, a.chunk) for a in actions]
        done = step.carried
    latency = round(spec.message_ms * TICKS_PER_MS)
    sched, paused = _timed(orders, costs, latency, pauses)
    busy, stalls, inflight_max, inflight_mean = [], [], [], []
    for s in range(stages):
        b, idle, peak, area = analyse_stage(sched, s, res, chunks, latency, True, paused[s], costs)
        busy.append(b)
        stalls.append(idle)
        inflight_max.append(peak)
        inflight_mean.append(area / sched.makespan if sched.makespan else 0.0)
    ms = 1.0 / TICKS_PER_MS
    return Prediction(stages, window, chunks, schedule, n, tuple(len(r) for r in ranges), sched.makespan * ms,
                      tuple(b * ms for b in busy), tuple({c: v * ms for c, v in st.items()} for st in stalls),
                      tuple(inflight_max), tuple(inflight_mean), batch_size)


def plan(spec: SpaceSpec, stages_list: Iterable[int] = (1, 2, 4, 8, 16, 32, 64), window: int = 16, chunks: int = 1,
         schedule: str = "csp", subnets_per_step: int = 1, **kwargs: Any) -> list[Prediction]:
    """:func:`simulate` for each stage count that fits the space (at most one stage per block); with
    ``subnets_per_step`` as :func:`plan_layouts` has it."""
    spec, chunks = _steps_of(spec, chunks, subnets_per_step)
    return [simulate(spec, s, window, chunks, schedule, **kwargs) for s in stages_list if s <= len(spec.blocks)]


def plan_layouts(spec: SpaceSpec, processes: int, window: int = 16, chunks: int = 1, schedule: str = "csp",
                 subnets_per_step: int = 1, **kwargs: Any) -> list[Prediction]:
    """:func:`simulate` for every layout of ``processes``: ``S`` stages x ``D = processes / S`` replicas, for each
    ``S`` that divides ``processes``, fits the space (at most one stage per block) and leaves a step's
    ``subnets_per_step * chunks`` micro-batches a multiple of ``D``; by increasing ``S``. With several subnets per
    training step (the recipes of :mod:`..pipeline.step_sampling`), a step is modelled as one subnet of that many
    times a subnet's compute in ``subnets_per_step * chunks`` micro-batches and one update (:func:`_steps_of`), and
    the rates count steps. ``kwargs`` go to :func:`simulate` (its ``subnets``: how many to simulate; its ``nodes``:
    the nodes the processes span)."""
    spec, chunks = _steps_of(spec, chunks, subnets_per_step)
    return [simulate(spec, s, window, chunks, schedule, replicas=d, **kwargs)
            for s, d in fitting_layouts(processes, len(spec.blocks), chunks)]


def fitting_layouts(processes: int, blocks: int, micro_batches: int) -> list[tuple[int, int]]:
    """``(stages, replicas)`` of every layout :func:`plan_layouts` weighs: ``stages`` divides ``processes``, is at
    most ``blocks``, and the replicas divide a training step's ``micro_batches`` (``subnets * chunks``)."""
    return [(s, processes // s) for s in range(1, processes + 1)
            if processes % s == 0 and s <= blocks and micro_batches % (processes // s) == 0]


def _steps_of(spec: SpaceSpec, chunks: int, subnets: int) -> tuple[SpaceSpec, int]:
    """``spec`` and ``chunks`` for training steps of ``subnets`` subnets as the planner sees them: every candidate's
    compute ``subnets`` times its own, in ``subnets * chunks`` micro-batches (they flow like one subnet's, and the
    step updates once). The subnets of a step differ, so this is the mean step of uniformly sampled subnets, not
    of a given sampler's."""
    if subnets < 1:
        raise ValueError(f"subnets_per_step must be >= 1, got {subnets}")
    if subnets == 1:
        return spec, chunks
    return spec.compute_scaled(lambda ms: ms * subnets), chunks * subnets


def best_layout(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest prediction (most subnets/s); on a tie, the one with fewer stages."""
    return max(predictions, key=lambda p: (p.subnets_per_s, -p.stages))


def _stage_costs(spec: SpaceSpec, picks: Sequence[Resource], chunks: int, s: int, stages: int,
                 scale: float, defer: bool = False) -> dict[str, int]:
    """Ticks of F and B per chunk, and of U, for one subnet on stage ``s``; compute times ``scale``; and
    :data:`SEND`, the ticks from a B's start to its gradient's send (its end unless ``defer``)."""
    ops = [spec.blocks[b].candidates[k] for b, k in picks]
    over = spec.action_overhead_ms * scale
    messages = spec.message_cpu_ms * ((s > 0) + (s < stages - 1))  # F and B each receive and send one
    split = passes(ops, s == stages - 1) if defer else None
    backward = sum(o.backward_ms for o in ops) if split is None else sum(split)
    after = 0.0 if split is None else split[1]
    b = _ticks(scale * backward / chunks + over + messages)
    # The replicas' streamed reduction of the subnet's gradients on this stage (0 without replicas).
    replicas = round(spec.reduce_hops / 2) + 1
    links = spec.replica_links or LinkModel.uniform(spec.message_ms + spec.message_cpu_ms, spec.message_ms_per_mb)
    reduce = (streamed_chain_ms(links, sum(o.grad_bytes for o in ops), replicas, s * replicas)
              + replica_update_ms(spec, ops, replicas, scale))
    return {FORWARD: _ticks(scale * sum(o.forward_ms for o in ops) / chunks + over + messages), BACKWARD: b,
            SEND: b - round(scale * after / chunks * TICKS_PER_MS),
            UPDATE: _ticks(scale * spec.update_ms * sum(o.stateful for o in ops) + over + reduce)}


def _timed(orders: Sequence[Sequence[Action]], costs: list[list[dict[str, int]]], latency: int,
           pauses: Sequence[Mapping[int, tuple[int, int]]] = ()) -> tuple[Schedule, list[dict[int, int]]]:
    """Run fixed per-stage orders with these costs, as the stage processes do.

    An F on ``s > 0`` (a B on ``s < S-1``) first receives its activation (gradient): the transport
    moves a message once the receiver asks for it and the sender has sent it (a rendezvous), so the
    receiver waits ``latency`` from then on, however early the message was sent. ``pauses[s][p]``:
    ``(fixed, reading)`` ticks stage ``s`` spends before its action at position ``p`` (a window's
    overheads); ``reading`` is paid first out of the time the stage waited for messages since its
    previous pause, as the stages read the next window's batches while they wait.

    Returns:
        The timed schedule, and per stage the ticks each pause took.
    """
    last = len(orders) - 1
    start: dict[tuple[int, Action], int] = {}
    finish: dict[tuple[int, Action], int] = {}
    pc, free, waited = [0] * len(orders), [0] * len(orders), [0] * len(orders)
    paused: list[dict[int, int]] = [{} for _ in orders]
    while any(pc[s] < len(o) for s, o in enumerate(orders)):
        for s, o in enumerate(orders):
            while pc[s] < len(o):
                a = o[pc[s]]
                peer = s - 1 if a.kind == FORWARD else s + 1 if a.kind == BACKWARD else -1
                if 0 <= peer <= last and (peer, a) not in finish:
                    break
                at = free[s]
                if pauses and pc[s] in pauses[s]:
                    fixed, reading = pauses[s][pc[s]]
                    paused[s][pc[s]] = fixed + max(0, reading - waited[s])
                    at, waited[s] = at + paused[s][pc[s]], 0
                if 0 <= peer <= last:
                    sent = start[(peer, a)] + costs[a.subnet][peer][SEND] if a.kind == BACKWARD else finish[(peer, a)]
                    waited[s] += max(0, sent - at)
                    at = max(at, sent) + latency
                start[(s, a)], finish[(s, a)] = at, at + costs[a.subnet][s][a.kind]
                free[s], pc[s] = finish[(s, a)], pc[s] + 1
    return Schedule(tuple(tuple(o) for o in orders), start, finish), paused


def table(predictions: Sequence[Prediction], base: float | None = None) -> str:
    """A plain-text table of predictions (the CLI's output); speed-up is against ``base`` subnets/s (default: the
    1-stage, 1-replica row, else the first)."""
    if base is None:
        base = next((p.subnets_per_s for p in predictions if p.stages == 1 and p.replicas == 1),
                    predictions[0].subnets_per_s if predictions else 1.0)
    layouts = any(p.replicas > 1 for p in predictions)
    rows = [f"{'S x D' if layouts else 'stages':>6} {'subnets/s':>10} {'samples/s':>10} {'speed-up':>8} {'bubble':>7} "
            + " ".join(f"{c[:5]:>5}" for c in CAUSES) + f" {'in-flight max/mean':>19}"]
    for p in predictions:
        split = p.stall_split()
        samples = "-" if p.samples_per_s is None else f"{p.samples_per_s:.0f}"
        rows.append(f"{p.layout if layouts else p.stages:>6} {p.subnets_per_s:>10.1f} {samples:>10} "
                    f"{p.subnets_per_s / base:>7.2f}x "
                    f"{100 * p.bubble_ratio:>6.1f}% " + " ".join(f"{100 * split[c]:>4.0f}%" for c in CAUSES)
                    + f" {max(p.inflight_max):>10} / {sum(p.inflight_mean) / p.stages:<6.2f}")
    return "\n".join(rows)
