"""The training engine: a window of batches in, per-subnet updates and losses out.

Flow for one window (one Lightning batch)::

    batches ──► sampler (subnet i = f(seed, i)) ──► resources per stage ──► CSP schedule
            ──► this stage's actions ──► StageExecutor (forward / backward / update)

With one stage this *is* the sequential reference (the schedule degenerates to
``F0 B0 U0 F1 B1 U1 ...``); with N stages every process builds the same schedule and runs
its own row of it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_naspipe.pipeline.exactness.clipping import ClippingHook, UpdateClipping, clips, clips_by_norm
from lightning_naspipe.pipeline.exactness.distillation import Teachers, wants_teacher
from lightning_naspipe.pipeline.runtime.executor import StageExecutor, StageModule, Transport
from lightning_naspipe.pipeline.runtime.stage_run import StageRun
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.pipeline.runtime.window_end import BoundarySignals, agree_window_end, sum_losses
from lightning_naspipe.pipeline.runtime.window_plan import WindowPlan, plan_window
from lightning_naspipe.pipeline.exactness.grad_norm import NormExchange
from lightning_naspipe.pipeline.placement.layout import Layout
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.runtime.microbatch import Batch, split_batch
from lightning_naspipe.pipeline.runtime.optim import resource_parameters, restrict_param_groups, step_schedulers
from lightning_naspipe.pipeline.exactness.replicas import ReplicaGroup, ReplicaUpdates
from lightning_naspipe.transport.failures import FailureBoard
from lightning_naspipe.pipeline.offload.offload import Offloader
from lightning_naspipe.pipeline.offload.residency import WindowResidency
from lightning_naspipe.schedule.actions import FORWARD, Action
from lightning_naspipe.schedule.schedules import SCHEDULES
from lightning_naspipe.space.boundary import map_tensors
from lightning_naspipe.space.supernet import BlockValue, Resource
from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry
from lightning_naspipe.pipeline.exactness.ties import ties_of
from lightning_naspipe.pipeline.exactness.weight_grads import DeferralChooser, serialised


class EngineModule(StageModule, Protocol):
    """What the engine needs from the user's module (a LightningModule with the mixin)."""

    @property
    def naspipe_seed(self) -> int: ...

    @property
    def trainer(self) -> Any: ...

    def sample_subnet(self, index: int) -> dict[str, int]: ...

    def sample_step(self, step: int) -> Sequence[dict[str, int]]: ...

    def optimizers(self) -> Any: ...


class Engine:
    """Trains windows of subnets on one stage of the pipeline.

    Args:
        stage_blocks: the block indices of every stage, in stage order (contiguous ranges).
        stage: which of them this process runs.
        chunks: micro-batches per subnet (all replicas together).
        transport: moves tensors between stages; ``None`` with one stage.
        replicas: the data-parallel replicas of this stage (see :mod:`.replicas`), ``None`` with one: each
            trains its contiguous share of every subnet's ``chunks`` micro-batches, and the updates sum their
            gradients in micro-batch order, so results never depend on their number.
        schedule: one of :data:`SCHEDULES` (see :func:`scheduling_resources`).
        offloader: keeps this stage's resources in host memory between uses (``offload=True``).
        memory_budget: ``(bytes, per-stage resource sizes)``: schedule so that each stage's in-flight
            resources fit (see :func:`~.residency.memory_conflicts`); the same on every stage process.
        telemetry: records this stage's timeline (busy, waiting, drain, in-flight depth).
        lookahead: run the next window's forwards in this window's drain when :meth:`train_window`
            is given the next window's batches (see :mod:`.lookahead`); ``"csp"`` with several stages,
            no offloader and no memory budget only. Results never depend on it.
        defer_weight_grads: compute a backward's weight gradients after sending its input gradients
            (see :mod:`.weight_grads`): ``None`` measures whether it pays (:class:`DeferralChooser`),
            ``True``/``False`` forces it. Results never depend on it.
        clip_norms: plan a gradient-norm exchange in every update (several stages), so that a norm clip
            is exact (see :mod:`.clipping`); ``None``: when the module's Trainer clips by norm or it
            overrides ``configure_gradient_clipping`` (:func:`.clipping.clips_by_norm`).
        clipping_hook: the Trainer's clipping call around each optimizer step (:data:`.clipping.ClippingHook`), given
            by the Lightning glue; ``None`` without Lightning, where nothing clips but the module's own code.
    """

    def __init__(
        self,
        stage_blocks: Sequence[range],
        stage: int = 0,
        chunks: int = 1,
        transport: Transport | None = None,
        schedule: str = "csp",
        offloader: Offloader | None = None,
        memory_budget: tuple[int, Sequence[dict[Any, int]]] | None = None,
        telemetry: StageTelemetry | None = None,
        lookahead: bool = False,
        defer_weight_grads: bool | None = None,
        clip_norms: bool | None = None,
        replicas: ReplicaGroup | None = None,
        clipping_hook: ClippingHook | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        self.stage_blocks = list(stage_blocks)
        self.stage = stage
        self.chunks = chunks
        self.transport = transport
        self.schedule = schedule
        self.offloader = offloader
        self.memory_budget = memory_budget
        self.telemetry = telemetry
        #: Seconds this stage has computed in windows (waiting for neighbours excluded): rebalancing input.
        self.busy_s = 0.0
        #: The resources this stage's windows may have changed (weights stepped, buffers updated in a forward)
        #: since the strategy last gave every stage the current weights; it clears the set then.
        self.changed: set[Resource] = set()
        #: Flags the stages agree on at each window's end (preemption signals); set by the strategy.
        self.signals: BoundarySignals | None = None
        self.lookahead = lookahead
        #: Forwards (chunks) this stage has run in the window before their own (lookahead).
        self.forwards_ahead = 0
        # The next window with the forwards this stage already ran for it, and what they keep for backward.
        self._ahead: tuple[Window, frozenset[tuple[int, Action]]] | None = None
        self._stash: dict[tuple[int, int], list[tuple[Any, Any]]] = {}
        self.deferral = DeferralChooser(forced=defer_weight_grads)
        #: Windows this stage ran with its weight gradients deferred (see :mod:`.weight_grads`).
        self.windows_deferred = 0
        #: Called with a subnet's index after its update and per-step scheduler step on this stage, when the
        #: optimizer is as the next subnet will find it (the mixin takes what a plain run logs then).
        self.after_update: Callable[[int], None] | None = None
        self.clip_norms = clip_norms
        self.clipping_hook = clipping_hook
        self._clipping: UpdateClipping | None = None
        self.replicas = replicas
        #: The micro-batches of each training step this replica trains (:meth:`chunk_share_of`): set by each
        #: training window, once its steps' subnets are known (evaluation forwards use none).
        self.chunk_share = range(0)
        self._replica_updates: ReplicaUpdates | None = None
        self._teachers = Teachers(replicas)
        self._stage_executor: StageExecutor | None = None
        #: Evaluation forwards this stage has run (:meth:`evaluate`; with replicas, :meth:`evaluate_shard` runs one
        #: per replica where every replica ran each).
        self.evaluations = 0

    def chunk_share_of(self, subnets: int) -> range:
        """The micro-batches of a training step of ``subnets`` subnets that this replica trains
        (:meth:`.Layout.chunk_share`)."""
        if self.replicas is None:
            return range(subnets * self.chunks)
        layout = Layout(len(self.stage_blocks), self.replicas.replicas)
        return layout.chunk_share(self.chunks, self.replicas.replica, subnets)

    def close(self) -> None:
        """Release the links to the other replicas and what the engine attached to the module (their
        BatchNorm hooks)."""
        if self._replica_updates is not None:
            self._replica_updates.close()
            self._replica_updates = None
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None

    @property
    def blocks(self) -> range:
        """The blocks this stage runs."""
        return self.stage_blocks[self.stage]

    def metrics(self) -> dict[str, float]:
        """This stage's offload accounting and telemetry (``offload/<stat>``, ``telemetry/<stat>``)."""
        found: dict[str, float] = {}
        if self.offloader is not None:
            found.update({f"offload/{k}": v for k, v in self.offloader.stats.as_metrics().items()})
        if self.telemetry is not None:
            found.update({f"telemetry/{k}": v for k, v in self.telemetry.metrics().items()})
            found["telemetry/windows_deferred"] = float(self.windows_deferred)
        return found

    def train_window(self, module: EngineModule, batches: Sequence[Batch], first_index: int,
                     upcoming: Sequence[Batch] | None = None) -> Window:
        """Train subnets ``first_index, first_index + 1, ...`` on ``batches``, one batch each.

        Args:
            upcoming: the next window's batches, if it is known to follow: with :attr:`lookahead`, some
                of its forwards run in this window's drain. Every stage must pass the same.

        Returns:
            The window: its architectures and, on the last stage, each subnet's loss.
        """
        supernet = module.supernet
        ahead, done = self._ahead or (None, frozenset[tuple[int, Action]]())
        if ahead is not None and ahead.first_index == first_index and len(ahead.architectures) == len(batches):
            window, self._ahead = ahead, None  # with the batches the forwards run ahead used
        else:
            self.drop_lookahead()
            window, done = self._window(module, batches, first_index), frozenset()
        looks_ahead = (self.lookahead and len(self.stage_blocks) > 1 and self.schedule == "csp"
                       and self.offloader is None and self.memory_budget is None)
        following = self._window(module, upcoming, first_index + len(batches)) if upcoming and looks_ahead else None
        norms = len(self.stage_blocks) > 1 and (clips_by_norm(module) if self.clip_norms is None else self.clip_norms)
        subnets = {len(step) for step in window.steps + (following.steps if following is not None else [])}
        if len(subnets) != 1:
            raise NASPipeConfigError(
                f"The training steps of one window train {sorted(subnets)} subnets each (sample_step): give every "
                "step the same number.")
        count = subnets.pop()
        self.chunk_share = self.chunk_share_of(count)
        relays = self.replicas is not None and count > 1 and wants_teacher(module)  # see distillation.py
        return self.run_window(module, plan_window(supernet, window, self.stage_blocks, self.schedule,
                                                   len(self.chunk_share), self.memory_budget, following, done,
                                                   norms, chained_last=relays))

    def drop_lookahead(self) -> None:
        """Forget the forwards run ahead for a next window that did not come (e.g. the epoch ended)."""
        if self._ahead is None:
            return
        first = self._ahead[0].first_index
        self._ahead = None
        for key in [key for key in self._stash if key[0] >= first]:
            del self._stash[key]
        if self._replica_updates is not None:
            self._replica_updates.drop_from(first)
        self._teachers.drop_from(first)
        if self.transport is not None:
            self.transport.drop_from(first)

    def _window(self, module: EngineModule, batches: Sequence[Batch], first_index: int) -> Window:
        steps = [[module.supernet.validate(a) for a in module.sample_step(first_index + k)]
                 for k in range(len(batches))]
        if not all(steps):
            raise NASPipeConfigError("sample_step returned no architecture; give at least one per training step.")
        return Window(first_index, [step[0] for step in steps], [split_batch(batch, self.chunks) for batch in batches],
                      steps=steps)

    def run_window(self, module: EngineModule, plan: WindowPlan) -> Window:
        """Run this stage's row of ``plan``: forwards, backwards and per-subnet updates."""
        window, resources = plan.window, [r[self.stage] for r in plan.resources]
        self.changed.update(*resources)
        eligible = self.chunks == 1 and serialised(plan.resources, plan.size, self.stage)
        actions = plan.actions(self.stage)
        stage_run = self._stage_run(module, plan, actions, resources, eligible)
        residency = stage_run.residency

        def update(k: int) -> None:
            self.update(module, window.first_index + k, resources[k])
            if residency is not None:
                residency.after_update(k)

        if self.telemetry is not None:
            self.telemetry.begin_window()
        self._clipping = self._update_clipping(module, plan.schedule.norms)
        if self.transport is not None:
            self.transport.begin_window(plan.run_schedule(), window.first_index)
        executor = self._executor(module)
        start, waited = time.perf_counter(), self._wait_s()
        executor.run(actions, window, update, stage_run)
        self.busy_s += time.perf_counter() - start - (self._wait_s() - waited)
        if eligible:
            self.deferral.record(stage_run.defer_weight_grads, executor.seconds_to_send)
        if residency is not None:
            residency.finish()
        own = self._own_part(window, plan)
        agree_window_end(own, self.transport, self.replicas, self.signals)
        if self.telemetry is not None:
            self.telemetry.end_window()
        return own

    def _stage_run(self, module: EngineModule, plan: WindowPlan, actions: Sequence[Action],
                   resources: Sequence[frozenset[Resource]], eligible: bool) -> StageRun:
        """This window's optional collaborators on this stage."""
        defer = self.deferral.pick(self.blocks, self.stage == 0, eligible)
        self.windows_deferred += defer
        ties = ties_of(module.supernet, self.stage_blocks)
        updates = self._updates(module)
        if updates is not None:
            first = plan.window.first_index
            updates.params.update({first + k: self._update_params(module, resources[k])
                                   for k in range(len(plan.window.architectures))})
        residency = None
        if self.offloader is not None:
            order = [a.subnet for a in actions if a.kind == FORWARD and a.chunk == 0]
            residency = WindowResidency(self.offloader, order, resources)
        return StageRun(chunk_offset=self.chunk_share.start,
                        ties=ties.routes(self.stage, plan.resources) if ties is not None else None,
                        replicas=updates, telemetry=self.telemetry, defer_weight_grads=defer, residency=residency)

    def _own_part(self, window: Window, plan: WindowPlan) -> Window:
        """The part of ``window`` this window trained, with its losses; the rest (forwards run ahead for the
        next window) is kept for the next :meth:`train_window`."""
        last = self.stage == len(self.stage_blocks) - 1
        records = sum_losses(window, plan.size, self.chunk_share, self.replicas) if last else window.records
        own, following = window.split(plan.size)
        own.records = records
        if following is not None:
            self._ahead = (following, plan.carried)
            self.forwards_ahead += sum(s == self.stage for s, _ in plan.carried)
        return own

    def evaluate(self, module: EngineModule, batch: Batch, architecture: dict[str, int]) -> BlockValue:
        """Subnet ``architecture``'s output for ``batch`` (no backward), on every stage."""
        architecture = module.supernet.validate(architecture)
        ties = ties_of(module.supernet, self.stage_blocks)
        stage_run = StageRun(ties=ties.routes(self.stage, None) if ties else None)
        keys = module.supernet.resources(self.blocks, architecture)
        if self.offloader is not None:
            self.offloader.acquire(keys)
        self.evaluations += 1
        try:
            output = self._executor(module).forward_only(batch, architecture, stage_run)
        finally:  # an error must not leave the resources counted as in use
            if self.offloader is not None:
                self.offloader.release(keys)
        if self.transport is not None:
            self.transport.end_window()
            output = self.transport.share(output)
        return output

    def evaluate_shard(self, module: EngineModule, count: int, batch: Batch | None,
                       architecture: dict[str, int] | None, device: torch.device) -> list[BlockValue]:
        """The outputs of ``count`` evaluation forwards (at most one per replica), every one on every rank.

        Replica ``r < count`` runs its ``batch`` under ``architecture`` through its own pipeline (:meth:`evaluate`);
        a replica ``count`` or beyond runs nothing (pass ``None``). The replicas then exchange their outputs, so every
        rank holds all ``count``, in replica order, on ``device``. The replicas hold the same weights and run the same
        forward, so each output is bit for bit what :meth:`evaluate` gives on any replica; the exchange only copies.
        Collective over this stage's replicas and along each pipeline: every rank passes the same ``count``.
        """
        if self.replicas is None or not 1 <= count <= self.replicas.replicas:
            raise ValueError(f"evaluate_shard takes 1 to {self.replicas.replicas if self.replicas else 1} forwards "
                             f"(one per replica), got {count}")
        mine = self.replicas.replica < count
        if mine != (batch is not None and architecture is not None):
            raise ValueError(f"replica {self.replicas.replica} of {count} forwards must get a batch and an "
                             "architecture exactly when it runs one")
        own = self.evaluate(module, batch, architecture) if mine else None  # type: ignore[arg-type]
        outputs = self.replicas.gather(own)[:count]
        return [map_tensors(lambda t: t if t.device == device else t.to(device), value) for value in outputs]

    def _update_clipping(self, module: EngineModule, norms: bool) -> UpdateClipping | None:
        """How this window's updates clip; ``None`` where they need nothing (one stage, no clipping)."""
        stages = len(self.stage_blocks)
        if stages == 1 and not clips(module):
            return None
        transport = self.transport
        device = transport.device if transport is not None else torch.device("cpu")

        def exchange(index: int) -> NormExchange:
            assert transport is not None
            return NormExchange(transport, self.stage, stages, index, device)

        return UpdateClipping(self.stage, stages, exchange if norms and stages > 1 else None, self.clipping_hook)

    def _wait_s(self) -> float:
        """Seconds this stage has waited for messages from other stages and its replicas."""
        return ((self.transport.wait_s if self.transport is not None else 0.0)
                + (self.replicas.wait_s if self.replicas is not None else 0.0))

    @property
    def failures(self) -> FailureBoard | None:
        """Where this process posts the error that stops it, for the other processes to name (``None`` alone)."""
        if self.transport is not None:
            return self.transport.failures
        return self.replicas.failures if self.replicas is not None else None

    def _executor(self, module: EngineModule) -> StageExecutor:
        """The stage executor, built again only when the module, this stage's blocks or the transport changed
        (a layout switch, moved blocks)."""
        executor = self._stage_executor
        if (executor is None or executor.module is not module or executor.blocks != self.blocks
                or executor.transport is not self.transport or executor.seed != module.naspipe_seed):
            executor = self._stage_executor = StageExecutor(
                module=module, stage=self.stage, num_stages=len(self.stage_blocks), blocks=self.blocks,
                seed=module.naspipe_seed, transport=self.transport, stash=self._stash, teachers=self._teachers)
        return executor

    def _updates(self, module: EngineModule) -> ReplicaUpdates | None:
        if self.replicas is not None and self._replica_updates is None:
            owner = module if isinstance(module, nn.Module) else None
            self._replica_updates = ReplicaUpdates(self.replicas, module.supernet, owner)
        return self._replica_updates

    def _update_params(self, module: EngineModule, resources: frozenset[Resource]) -> list[torch.Tensor]:
        """The parameters an update of a subnet with ``resources`` on this stage steps."""
        supernet = module.supernet
        params = resource_parameters(supernet.resource_state(r) for r in sorted(resources))
        ties = ties_of(supernet, self.stage_blocks)
        if ties is not None:  # a resource tied across stages: this stage steps its own part only
            params = ties.owned(self.stage, params)
        return params

    def update(self, module: EngineModule, index: int, resources: frozenset[Resource]) -> None:
        """Step the optimizer on the parameters of subnet ``index``'s ``resources`` on this stage, then
        per-step schedulers."""
        params = self._update_params(module, resources)
        if self._replica_updates is not None:
            self._replica_updates.reduce(index, self.chunk_share, params)
        optimizer = module.optimizers()
        assert not isinstance(optimizer, list)
        if self.offloader is not None:
            self.offloader.note_gradients(params)
        clipping = self._clipping
        with (clipping.step(module, optimizer.optimizer, params, index) if clipping else contextlib.nullcontext()), \
                restrict_param_groups(optimizer.optimizer, params):
            optimizer.step()
        for p in params:
            p.grad = None
        trainer = module.trainer
        if trainer.lr_scheduler_configs:  # callback_metrics alone costs tens of microseconds per update
            step_schedulers(trainer.lr_scheduler_configs, "step", index + 1, trainer.callback_metrics)
        if self.after_update is not None:
            self.after_update(index)
