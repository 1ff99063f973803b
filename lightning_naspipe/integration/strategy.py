"""``NASPipeStrategy``: pipeline-parallel supernet training as a Lightning strategy.

Thin glue: Lightning's loop hands the mixin one *window* per batch (see :mod:`.data`), the
mixin's ``training_step`` runs it through the strategy's :class:`~lightning_naspipe.pipeline.runtime.engine.Engine`
on this process's pipeline stage, and the results are bitwise those of a plain one-device ``Trainer``.
The strategy is built of parts: its processes (:mod:`.processes`), its Lightning namespace
(:mod:`.binding`) and the blocks each stage owns (:mod:`.stage_placement`); this module adds setup,
the training hooks and the data.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.arguments import check_all
from lightning_naspipe.integration.batch_hooks import call_per_subnet_batch, stop_calling_per_subnet_batch
from lightning_naspipe.integration.binding import bind_classes
from lightning_naspipe.integration.callback import StageWeightsSync
from lightning_naspipe.integration.data import (
    DataTracker,
    WindowLoader,
    refuse_distributed_sampler,
    train_batch_limit,
    transfer_hooks_overridden,
)
from lightning_naspipe.transport.distributed import drop_foreign_state, gather_objects
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.runtime.microbatch import check_batch_sizes
from lightning_naspipe.integration.mixin import NASPipeMixin, resolve_chunks
from lightning_naspipe.pipeline.placement.partition import block_weights
from lightning_naspipe.integration.preemption import SigtermAgreement
from lightning_naspipe.integration.processes import lost_process_named
from lightning_naspipe.integration.progress import count_subnets
from lightning_naspipe.integration.stepping import count_subnet_steps, stop_counting_subnet_steps
from lightning_naspipe.pipeline.placement.stage_table import chunks_hint, stage_table
from lightning_naspipe.space.supernet import supernet_of
from lightning_naspipe.integration.eval_steps import ShardedEvaluation
from lightning_naspipe.pipeline.runtime.telemetry import write_trace_files


# Lightning advises self.log(..., sync_dist=True) for epoch-level metrics of a distributed run. Every
# NASPipe stage computes the same values (outputs reach every stage), so the advice does not apply, and
# averaging them would only add rounding: ignored from the first multi-stage setup in a process on.
_SYNC_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)"


class NASPipeStrategy(ShardedEvaluation):
    """Trains a NASPipe supernet with causal-synchronous-parallel (CSP) pipelining.

    Use it as ``Trainer(strategy="naspipe", devices=N)`` or ``Trainer(strategy=NASPipeStrategy(...))``.
    The supernet's blocks are split into one contiguous stage per process. One Lightning batch is a
    window of ``window`` subnets, each trained on its own batch of the user's dataloader; ``global_step``,
    ``max_steps``, ``limit_train_batches`` and the progress bar count subnets, as in a plain run
    (docs/lightning.md lists every flag). Every stage sees the same batches.

    On CPU each stage process pins itself to its own share of the cores (see :mod:`.affinity`).

    Both ``lightning.pytorch`` and ``pytorch_lightning`` Trainers accept it. A new instance serves
    either: the Trainer that takes it binds it to its namespace (its class becomes
    ``LightningNASPipeStrategy`` or ``PytorchLightningNASPipeStrategy``), so use one instance per Trainer.

    Args:
        window: subnets per Lightning batch; the scheduler overlaps any of them whose parameters
            are disjoint. Results do not depend on it. At least 1.
        chunks: micro-batches each subnet's batch is split into (along dim 0), pipelined through the stages and
            shared by the replicas. ``None`` (the default): the module's ``chunks`` (:attr:`NASPipeMixin.chunks`),
            which the plain Trainer uses too, so every layout equals the plain run. A value different from one the
            module sets is refused; with a module that sets none it is used as given, and the log names the
            plain run it equals (the module with that ``chunks``). Another value changes the summation order.
        num_stages: pipeline stages; the processes (devices x nodes) run ``processes / num_stages``
            data-parallel replicas of the pipeline (so it must divide them; default: one stage per process,
            one replica). Ranks are stage-major: a stage's replicas are neighbouring ranks. Each replica trains
            a contiguous share of every training step's micro-batches (``chunks`` per subnet, so ``chunks`` times
            the subnets per step must be a multiple of the replicas; refused at the first training window
            otherwise), and the replicas sum their gradients in micro-batch order: results never depend
            on the layout. ``"auto"``: the layout the planner predicts fastest, chosen on the first training
            batch (every rank profiles a share of the supernet on its first micro-batch; logged, also as the
            loggers' hyperparameters ``naspipe/...``): the run starts
            with one stage per process and, if another layout wins, makes every rank whole and rebuilds the
            pipeline before the first window trains. Only layouts that leave a training step's ``subnets * chunks``
            a multiple of the replicas are considered.
        balance: blocks per stage, e.g. ``[3, 2, 4]``; default: balanced by each block's forward and backward
            time on one micro-batch, measured by every rank at once (a share of the candidates each), on the
            module's ``supernet_example_input`` when it sets one, else on the first training batch
            (``pipeline_input`` of it, on each rank's device): the run starts on a split by parameter counts and
            moves blocks, with their weights and optimizer state, before the first window trains. Results never
            depend on the split. That timing and ``"auto"``'s profile are cached on disk by space, device and input
            shape (``LIGHTNING_NASPIPE_CACHE``: the folder, ``0``: off; default ``~/.cache/lightning_naspipe``):
            reruns and resumes skip them. The log says what setup cost.
        schedule: ``"csp"`` (NASPipe); or, for comparison, ``"one_in_flight"`` (one subnet in the
            pipeline at a time, the research artifact's reproducible baseline), ``"gpipe"`` (the
            same with micro-batches filling and draining the pipeline per subnet; use ``chunks > 1``),
            or ``"async"`` (ignores parameter sharing between in-flight subnets: faster, but NOT
            reproducible). All but ``"async"`` keep the exactness contract.
        rebalance_every: after the first two windows and then every this many windows, the stages' measured
            busy times are compared and, when moving the busiest stage's edge block to a less busy neighbour
            would make it faster by 2% and by a quarter of its excess over the mean stage, the block moves
            (weights, buffers and optimizer state move with it; logged). Many small blocks walk the cut toward
            balance one check at a time. ``None`` keeps the
            split fixed; an explicit ``balance`` is never changed. Results never depend on it.
        offload: keep each stage's blocks (parameters, buffers and the optimizer state of
            candidates not in flight) in host memory — pinned on CUDA — and hold on the device only
            what in-flight subnets use plus a small prefetch buffer filled along the known schedule.
            Results are bitwise the same as without it. Turn it on when the supernet does not fit
            on the devices; it costs host-device copies (mostly hidden by the prefetch).
        offload_budget_bytes: with ``offload``, an optional cap on each stage's device-resident
            bytes for prefetching and caching; a subnet whose stage alone exceeds it is an error.
        lookahead: while a window drains, run forwards of the next one (already fetched by Lightning)
            on the stages that would idle, on every stage but the last and only through blocks without
            buffers, so every weight, buffer and gradient at a window's end is what sequential training
            has there (see :mod:`.lookahead`). Off with ``offload``, with a schedule other than
            ``"csp"``, and when the module or datamodule overrides a batch-transfer hook (Lightning
            would run it on the next batch again). Results never depend on it.
        defer_weight_grads: on every stage but the first, compute a backward's weight gradients after
            its input gradients are sent, so the stage before resumes sooner (see :mod:`.weight_grads`).
            ``None``: measured per stage over its first eligible windows (``chunks=1``, most consecutive
            subnets sharing a trainable block upstream, e.g. a stem), three each way, and kept where the
            input gradients left at least 5% sooner; never outside such windows. ``True``/``False``
            forces it. Results never depend on it.
        telemetry: log each stage's busy, waiting and drain time and in-flight depth
            (``telemetry/<stat>_stage<k>``) through the Trainer's loggers.
        trace_dir: also keep every action's interval and, when ``fit`` ends, write
            ``naspipe_trace.json`` (Chrome trace; open in Perfetto) and, if matplotlib is installed,
            ``naspipe_timeline.png`` to this folder (implies ``telemetry``).
        timeout: how long a stage waits for a neighbour or a collective before it declares
            that stage lost and fails the run; a number is seconds.
        process_group_backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``; default: gloo on CPU, NCCL on CUDA.
        transport: how activations and gradients travel between stages: ``"auto"`` (shared memory
            when every stage runs on one host and the backend is not NCCL, else ``torch.distributed``),
            ``"shared_memory"`` (an error where it cannot be used) or ``"torch"`` (point-to-point calls of
            the process group). Results never depend on it.
        start_method: ``"popen"`` (re-run the script per process, Lightning's default) or
            ``"spawn"``/``"fork"``/``"forkserver"`` (multiprocessing, e.g. for notebooks).
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer from ``devices``.
        cluster_environment: set by the Trainer (``torchrun``, SLURM, ... are detected).
        checkpoint_io: how checkpoints are written; default: Lightning's ``torch.save`` format, written
            crash-safe (a temporary file next to the target, fsynced and renamed over it; see
            :mod:`.checkpoint_io`).
        precision_plugin: set by the Trainer from ``precision``.
    """

    strategy_name = "naspipe"

    def __init__(
        self,
        window: int = 8,
        chunks: int | None = None,
        num_stages: int | Literal["auto"] | None = None,
        balance: Sequence[int] | None = None,
        schedule: str = "csp",
        rebalance_every: int | None = 16,
        offload: bool = False,
        offload_budget_bytes: int | None = None,
        lookahead: bool = True,
        defer_weight_grads: bool | None = None,
        telemetry: bool = False,
        trace_dir: str | None = None,
        timeout: timedelta | float = timedelta(minutes=3),
        process_group_backend: str | None = None,
        transport: Literal["auto", "shared_memory", "torch"] = "auto",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        checked = check_all(dict(
            window=window, chunks=chunks, num_stages=num_stages, balance=balance, schedule=schedule,
            rebalance_every=rebalance_every, offload=offload, offload_budget_bytes=offload_budget_bytes,
            lookahead=lookahead, defer_weight_grads=defer_weight_grads, telemetry=telemetry, trace_dir=trace_dir,
            timeout=timeout, process_group_backend=process_group_backend, transport=transport,
            start_method=start_method))
        self._init_plugins(accelerator=accelerator, parallel_devices=parallel_devices,
                           cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                           precision_plugin=precision_plugin)
        self._init_processes(num_stages, checked["timeout"], process_group_backend, start_method)
        self._init_placement(offload, offload_budget_bytes,
                             rebalance_every if balance is None else None)  # an explicit balance is kept
        self._init_building(window, chunks, checked["balance"], schedule, lookahead, defer_weight_grads, telemetry,
                            trace_dir, transport)
        if schedule == "async":
            rank_zero_warn("NASPipeStrategy(schedule='async') ignores parameter sharing between in-flight subnets: "
                           "results are not reproducible. Use it only as a speed baseline.")
        self._stages_reported = False
        self.data_tracker = DataTracker(self._trainer)
        self._train_limit: int | float | None = None  # the user's limit_train_batches during a fit
        self._stepping_trainer: Any = None  # the Trainer whose estimated_stepping_batches counts subnets
        self._loader: WindowLoader | None = None  # the fit's (a setup hook may load it before our setup)
        self._init_evaluation()

    @override
    def connect(self, model: Any) -> None:
        if not isinstance(model, NASPipeMixin):
            raise NASPipeConfigError(
                f"{type(model).__name__} does not use the NASPipe mixin: declare it as "
                f"class {type(model).__name__}(lightning_naspipe.NASPipeMixin, LightningModule)."
            )
        self.chunks, self._chunks_note = resolve_chunks(model, self.chunks_setting)
        super().connect(model)  # type: ignore[arg-type]  # the namespace's ParallelStrategy
        self._stepping_trainer = count_subnet_steps(self._trainer())  # before a hook reads it (setup, ...)

    # -- setup and the training loop ------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        assert self._namespace is not None, "bound by the Trainer"
        lightning.require_internals(self._namespace)  # before any collective: refuse, naming what is missing
        supernet = supernet_of(self.lightning_module)
        example = getattr(self.lightning_module, "supernet_example_input", None)
        if self.num_stages == "auto":  # one stage per process until the first training batch chooses
            self._stages = None
        self._choose_layout = self.num_stages == "auto" and self.world_size > 1 and trainer.training
        self._init_startup()
        if self._chunks_note is not None and trainer.training:
            self._info(self._chunks_note)
        weights = None
        if self.balance is None and example is not None and self.world_size > 1:
            weights = self._timed_weights(example)
        self._split_costs = (weights, "ms") if weights is not None else (block_weights(supernet), "params")
        self._stages_reported = False
        self._batch_at = self._ahead_for = (-1, -1)  # (epoch, batch_idx) of this window, of the lookahead's
        if trainer.training and self.layout.replicas > 1:  # before any training, not at the first window
            module: Any = self.lightning_module  # a NASPipeMixin (connect checked it)
            self.layout.check_chunks(self.chunks, len(module.sample_step(trainer.global_step)))
        self._build_engine(trainer.training)
        super().setup(trainer)
        if self.optimizers and not self._whole:
            drop_foreign_state(self.optimizers[0], self._owned())
        count_subnets(trainer.progress_bar_callback, self.data_tracker)
        if trainer.training:
            call_per_subnet_batch(self.lightning_module, self.data_tracker)
        if self.world_size > 1 and trainer.training and not any(isinstance(c, StageWeightsSync)
                                                                for c in trainer.callbacks):
            trainer.callbacks.insert(0, StageWeightsSync())
        if self.world_size > 1:
            warnings.filterwarnings("ignore", message=_SYNC_ADVICE)  # the same filter once, however many fits

    def _switch_layout(self, stages: int) -> None:
        """Rebuild the pipeline as ``stages`` stages x the rest replicas (collective, before a window trains):
        every rank first gets every block's weights and optimizer state."""
        if stages == self.layout.stages:
            return
        start = time.perf_counter()
        self._make_whole()
        self._release_engine()
        self._stages = stages
        self._build_engine(training=True)
        if self.optimizers and not self._whole:
            drop_foreign_state(self.optimizers[0], self._owned())
        self.model_to_device()
        self._wire_engine()
        self._startup.record("layout rebuild", time.perf_counter() - start)

    def _wire_engine(self) -> None:
        """Connect the engine to the training run (after Lightning's training start)."""
        assert self.engine is not None, "built at setup"
        self.engine.signals = self._agreement  # the flags travel with each window's losses
        if transfer_hooks_overridden(self._trainer(), self.lightning_module):
            self.engine.lookahead = False  # Lightning runs them on each batch it hands over
        if self.engine.transport is not None:
            self.engine.transport.idle = self._read_ahead  # every stage reads every batch: read while waiting

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.world_size > 1:  # after Lightning registered its signal handlers
            assert self._namespace is not None
            self._agreement = SigtermAgreement(self._namespace)
            self._agreement.install(self._trainer())
            self._wire_engine()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_at = (self._trainer().current_epoch, batch_idx)
        if self.engine is not None and self._ahead_for != self._batch_at:
            self.engine.drop_lookahead()  # the window it ran for did not come next (an epoch ended early)
        self._ahead_for = (-1, -1)
        with lost_process_named(self.engine.failures if self.engine is not None else None,
                                "the layout choice, the split's timing or a rebalancing check"):
            if self._choose_layout:
                self._choose_layout = False
                self._switch_layout(self._chosen_layout(batch[0]))
            if self._time_first_batch:
                self._time_first_batch = False
                self._balance_by_time(batch[0])
            if (setup := self._startup.report()) is not None:
                self._info(setup)
            self._windows += 1
            if self._rebalances_before(self._windows):
                self._rebalance()

    def upcoming_batches(self, first_index: int) -> list[Any] | None:
        """The next window's batches, on this stage's device, for the engine's lookahead: the window
        Lightning already fetched to train next in this epoch; ``None`` where lookahead cannot be used."""
        trainer = self._trainer()
        upcoming = self._loader.handed_out.get(first_index) if self._loader is not None else None
        if (upcoming is None or self.engine is None or not self.engine.lookahead or self.layout.stages == 1
                or self._rebalances_before(self._windows + 1)):  # blocks move first
            return None
        if trainer.max_steps >= 0:
            upcoming = upcoming[: max(0, trainer.max_steps - first_index)]
        if not upcoming:
            return None
        self._ahead_for = (self._batch_at[0], self._batch_at[1] + 1)
        # What Lightning does to a batch before training_step (transfer hooks, if overridden, turn lookahead off).
        return list(self.batch_to_device(self.precision_plugin.convert_input(upcoming)))

    def _read_ahead(self) -> bool:
        return self._loader is not None and self._loader.read_ahead()

    @override
    def on_train_end(self) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.idle = None
        if self.trace_dir is not None:
            self._write_trace()
        self._make_whole()

    def teardown(self) -> None:
        # After fit, validate, test or a failure: no copy thread left, and the supernet whole again.
        self._release_engine()
        supernet = getattr(self.lightning_module, "supernet", None)
        if supernet is not None:
            supernet.local_blocks = None
            stop_calling_per_subnet_batch(self.lightning_module)
        if self._train_limit is not None and self.lightning_module is not None:
            self.lightning_module.trainer.limit_train_batches = self._train_limit
            self._train_limit = None
        stop_counting_subnet_steps(self._stepping_trainer)
        self._stepping_trainer = self._loader = None
        super().teardown()

    def stage_metrics(self) -> dict[str, float]:
        """Every stage's offload accounting and telemetry, keyed ``offload/<stat>_stage<k>`` and
        ``telemetry/<stat>_stage<k>`` (``..._stage<k>_replica<r>`` with several replicas); the same on every
        rank (collective when there is any)."""
        mine = self.engine.metrics() if self.engine is not None else {}
        if not mine:  # offload and telemetry are off on every rank alike
            return {}
        layout = self.layout
        suffix = [f"_stage{layout.stage_of(rank)}" + (f"_replica{layout.replica_of(rank)}" if layout.replicas > 1
                                                      else "") for rank in range(layout.world_size)]
        ranks = gather_objects(mine, self.world_size)
        return {f"{name}{suffix[rank]}": value for rank, stats in enumerate(ranks) for name, value in stats.items()}

    def window_trained(self) -> None:
        """A window was trained (every stage): a checkpoint inside the epoch resumes from here."""
        self.data_tracker.window_trained()

    def report_stages(self) -> None:
        """Log the stage table (:mod:`.stage_table`) on rank 0 once, after the first window (collective)."""
        if self._stages_reported:
            return
        self._stages_reported = True
        transport = self.engine.transport if self.engine is not None else None
        sent = gather_objects(transport.first_activation if transport is not None else None, self.world_size)
        sends = [sent[rank] for rank in self.layout.column(0)]
        if self.is_global_zero:
            costs, unit = self._split_costs
            table = stage_table(supernet_of(self.lightning_module), self.stage_ranges, costs, unit, sends,
                                [self.layout.replica_ranks(s) for s in range(self.layout.stages)])
            hint = chunks_hint(supernet_of(self.lightning_module), self.stage_ranges, self.chunks)
            self._info(f"NASPipe stages:\n{table}" + (f"\n{hint}" if hint else ""))

    def _write_trace(self) -> None:
        assert self.engine is not None and self.engine.telemetry is not None and self.trace_dir is not None
        events = [e for part in gather_objects(self.engine.telemetry.chrome_events(), self.world_size) for e in part]
        if self.is_global_zero:
            write_trace_files(self.trace_dir, events)

    # -- data -----------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        refuse_distributed_sampler(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        training = trainer is not None and trainer.training
        check_batch_sizes(dataloader, self.chunks, supernet_of(self.lightning_module), training)
        if trainer is None or not training:
            # Evaluation: with several processes, read ahead for the replicas' groups (num_stages="auto" may choose
            # replicas after the sanity check, whose loaders the later validations reuse).
            return self.eval_shards.wrap(dataloader) if self.world_size > 1 else dataloader
        # ModelCheckpoint(every_n_train_steps=n) checks global_step % n after each window.
        triggers = [n for c in trainer.checkpoint_callbacks if (n := lightning.every_n_train_steps(c)) > 0]
        # limit_train_batches (and overfit_batches, which sets it) counts the user's batches here; Lightning,
        # which would count windows, is told to take the whole (window) loader. Restored at teardown.
        if self._train_limit is None:
            self._train_limit = trainer.limit_train_batches
        trainer.limit_train_batches = 1.0
        limit = train_batch_limit(self._train_limit, dataloader)  # type: ignore[arg-type]
        self._loader = WindowLoader(dataloader, self.window, self.data_tracker, triggers,  # type: ignore[arg-type]
                                    limit)
        return self._loader

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="NASPipe: reproducible CSP pipeline for supernets", override=True
        )


bind_classes(NASPipeStrategy)
