"""The pipeline half of ``NASPipeStrategy``: the engine settings, and building this process's part of the
current stages x replicas layout (its blocks, its links to neighbouring stages and to its stage's replicas,
the engine), at ``setup`` and again when ``num_stages="auto"`` chooses another layout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, cast

from lightning_naspipe.integration.auto_layout import chosen_stages
from lightning_naspipe.integration.preemption import SigtermAgreement
from lightning_naspipe.integration.stage_placement import StagePlacement
from lightning_naspipe.integration.startup import StartupMeasures
from lightning_naspipe.integration.precision_clipping import lightning_clipping
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.runtime.microbatch import split_batch
from lightning_naspipe.pipeline.placement.partition import stage_ranges
from lightning_naspipe.transport.distributed import gather_objects
from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry
from lightning_naspipe.space.supernet import supernet_of
from lightning_naspipe.transport.failures import FailureBoard, default_store
from lightning_naspipe.transport.p2p import P2PTransport
from lightning_naspipe.transport.replica_links import ReplicaLinks, layout_groups

__all__ = ["PipelineBuilding"]


class PipelineBuilding(StagePlacement):
    """Engine settings and building for ``NASPipeStrategy``, whose ``__init__`` calls :meth:`_init_building`."""

    def _init_building(self, window: int, chunks: int | None, balance: Sequence[int] | None, schedule: str,
                       lookahead: bool, defer_weight_grads: bool | None, telemetry: bool, trace_dir: str | None,
                       transport: Literal["auto", "shared_memory", "torch"]) -> None:
        """This part's settings (``NASPipeStrategy``'s arguments of the same names, ``balance`` checked)."""
        self.window = window
        #: ``NASPipeStrategy(chunks=...)`` as given; ``chunks`` is what the run uses, resolved against the module's
        #: when the Trainer connects it (``mixin.resolve_chunks``).
        self.chunks_setting = chunks
        self.chunks = chunks or 1
        self._chunks_note: str | None = None
        self.balance: list[int] | None = list(balance) if balance is not None else None
        self.schedule = schedule
        self.lookahead = lookahead
        self.defer_weight_grads = defer_weight_grads
        self.telemetry = telemetry or trace_dir is not None
        self.trace_dir = trace_dir
        self.transport = transport
        #: Preemption flags agreed at every window's end (installed at training start with several processes).
        self._agreement: SigtermAgreement | None = None
        #: Whether the first training batch chooses the layout (``num_stages="auto"``), and times the split.
        self._choose_layout = False
        self._time_first_batch = False
        #: Windows trained in this fit (rebalancing counts them).
        self._windows = 0

    def _build_engine(self, training: bool) -> None:
        """This process's part of the current layout: its stage's blocks (split by the costs the strategy has),
        the links to its neighbouring stages and to its stage's replicas, and the engine (collective)."""
        supernet = supernet_of(self.lightning_module)
        layout = self.layout
        stages = layout.stages
        timed = self._split_costs[1] == "ms"
        self.stage_ranges = stage_ranges(supernet, stages, self.balance, self._split_costs[0] if timed else None)
        # Without a balance or timed costs, the first real batch is timed (on_train_batch_start).
        self._time_first_batch = self.balance is None and not timed and stages > 1
        self._windows, self._busy_before = 0, [0.0] * stages
        telemetry = StageTelemetry(self.stage, keep_trace=self.trace_dir is not None) if self.telemetry else None
        column_group, replica_group = layout_groups(layout, self.root_device) if layout.replicas > 1 else (None, None)
        names = [layout.name(rank) for rank in range(layout.world_size)]
        transport = None
        if stages > 1:
            transport = P2PTransport(self.stage, layout.column(self.replica), self.root_device, self.timeout,
                                     links=self.transport, spin_s=self.receive_spin_s, group=column_group, names=names)
            transport.telemetry = telemetry
        replicas = None
        if layout.replicas > 1:
            failures = transport.failures if transport is not None else FailureBoard(default_store(), self.global_rank,
                                                                                     names)
            replicas = ReplicaLinks(self.replica, layout.replica_ranks(self.stage), names, replica_group,
                                    self.root_device, self.timeout, failures, self.transport, self.receive_spin_s)
        self.engine = Engine(self.stage_ranges, stage=self.stage, chunks=self.chunks, transport=transport,
                             schedule=self.schedule, telemetry=telemetry, lookahead=self.lookahead and not self.offload,
                             defer_weight_grads=self.defer_weight_grads, replicas=replicas,
                             clipping_hook=lightning_clipping)
        supernet.local_blocks = self.engine.blocks if stages > 1 else None
        self._whole = not (training and stages > 1)
        if self.offload:
            self._build_offloader()

    def _balance_by_time(self, batch: Any) -> None:
        """Time the blocks on a micro-batch of ``batch`` (the window's first) on this stage's device and move to
        the split that balances that time (collective)."""
        assert self.lightning_module is not None
        supernet = supernet_of(self.lightning_module)
        example = self.lightning_module.pipeline_input(batch)  # type: ignore[operator]
        weights = self._timed_weights(example)
        self._split_costs = (weights, "ms")
        start = time.perf_counter()
        self._move_to(stage_ranges(supernet, self.layout.stages, None, weights),
                      "balanced by block time measured on the first batch")
        self._startup.record("moving blocks", time.perf_counter() - start)

    def _timed_weights(self, example: Any) -> list[float]:
        """Each block's time on one micro-batch of ``example`` (what the first block receives for one subnet
        batch), as a stage runs it: from this run's profile or the cache, else timed by every rank at once, a
        share each, and joined (collective; :mod:`.startup`)."""
        return self._startup.split_weights(split_batch(example, self.chunks)[0][0])

    def _init_startup(self) -> None:
        """This fit's start-up measurements (:mod:`.startup`), at setup."""
        self._startup = StartupMeasures(supernet_of(self.lightning_module), self.root_device, self.global_rank,
                                        self.world_size, lambda value: gather_objects(value, self.world_size),
                                        self.broadcast)

    def _chosen_layout(self, batch: Any) -> int:
        """``num_stages="auto"``'s stages for the run, planned on a micro-batch of ``batch`` (collective; the
        choice is logged, and recorded as the loggers' hyperparameters ``naspipe/...``); with several stages and no
        ``balance``, the split's weights come from the profile."""
        module = cast(Any, self.lightning_module)
        micro = split_batch(module.pipeline_input(batch), self.chunks)[0][0]
        subnets = len(module.sample_step(module.global_step))  # every step of a run trains as many
        stages, message, hparams = chosen_stages(
            lambda deferred: self._startup.profile(micro, deferred), self.world_size, len(supernet_of(module)),
            self.chunks, self.window, self.is_global_zero, self.broadcast, self.root_device.type, subnets,
            self.defer_weight_grads, self.layout.nodes)
        self._info(message)
        if self.is_global_zero:  # and where runs are compared: a CSVLogger's hparams.yaml, TensorBoard's HPARAMS
            for logger in module.trainer.loggers:
                logger.log_hyperparams(hparams)
        if stages > 1 and stages != self.layout.stages and self.balance is None:
            self._split_costs = (self._startup.split_weights(micro), "ms")  # the rebuild splits by them
        return stages
