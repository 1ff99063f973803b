"""``NASPipeStrategy``: pipeline-parallel supernet training as a Lightning strategy.

Thin glue: Lightning's loop hands the mixin one *window* per batch (see :mod:`.data`), the
mixin's ``training_step`` runs it through the strategy's :class:`~.engine.Engine`, and the
engine's results are bitwise those of a plain one-device ``Trainer``.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.strategies.strategy import TBroadcast
from pytorch_lightning.trainer.states import RunningStage
from typing_extensions import override

from lightning_naspipe.callback import NASPipeCallback, validate_run
from lightning_naspipe.data import DataTracker, WindowLoader
from lightning_naspipe.engine import Engine
from lightning_naspipe.errors import NASPipeConfigError


class NASPipeStrategy(ParallelStrategy):
    """Trains a NASPipe supernet with causal-synchronous-parallel (CSP) pipelining.

    Use it as ``Trainer(strategy="naspipe")`` or ``Trainer(strategy=NASPipeStrategy(window=16))``.
    One Lightning batch is a window of ``window`` subnets, each trained on its own batch of the
    user's dataloader, so ``global_step`` and ``max_steps`` count subnets while the progress bar
    and ``limit_train_batches`` count windows.

    Args:
        window: subnets per Lightning batch; the scheduler may overlap any of them whose
            parameters are disjoint. Results do not depend on it. At least 1.
        chunks: micro-batches each subnet's batch is split into (along dim 0). Results are
            exact for a fixed ``chunks``; changing it changes the summation order.
        num_stages: pipeline stages; defaults to the number of processes (devices × nodes).
            Only one stage is supported in this release.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer from ``devices``.
        cluster_environment: set by the Trainer.
        checkpoint_io: how checkpoints are written; Lightning's default ``torch.save`` format.
        precision_plugin: set by the Trainer from ``precision``.
    """

    strategy_name = "naspipe"

    def __init__(
        self,
        window: int = 8,
        chunks: int = 1,
        num_stages: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        _check_positive("window", window, "the number of subnets per Lightning batch, e.g. window=8")
        _check_positive("chunks", chunks, "the number of micro-batches per subnet, e.g. chunks=1")
        if num_stages is not None:
            _check_positive("num_stages", num_stages, "the number of pipeline stages, or None for one per process")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.window = window
        self.chunks = chunks
        self.num_stages = num_stages
        self.engine: Engine | None = None
        self.data_tracker = DataTracker(lambda: self.lightning_module.trainer)  # type: ignore[union-attr]

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices"
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a shuffling, sharding DistributedSampler for distributed strategies;
        # every stage must see the whole batch sequence of the one-device run, so never.
        return False

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if model._trainer is not None:
            validate_run(model._trainer, model)  # before Lightning's own, less fitting, advice
        super().connect(model)

    @override
    def setup_environment(self) -> None:
        stages = self.num_stages if self.num_stages is not None else self.world_size
        if self.world_size != 1 or stages != 1:
            raise NASPipeConfigError(
                f"NASPipeStrategy got {self.world_size} process(es) and num_stages={stages}; this release runs "
                "one stage on one device. Use devices=1 (and num_nodes=1)."
            )
        super().setup_environment()
        # Runs after the module's configure_callbacks and before checkpoint restore, so a module
        # that overrides configure_callbacks still gets the callback and its resume state.
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if not any(isinstance(c, NASPipeCallback) for c in trainer.callbacks):
            trainer.callbacks.append(NASPipeCallback())

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.model_to_device()
        supernet = self.lightning_module._supernet()  # type: ignore[operator]
        self.engine = Engine([range(len(supernet))], stage=0, chunks=self.chunks)
        super().setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return WindowLoader(dataloader, self.window, self.data_tracker)  # type: ignore[arg-type]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return obj

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="NASPipe: reproducible CSP pipeline for supernets", override=True
        )


def _check_positive(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NASPipeConfigError(f"NASPipeStrategy({name}={value!r}) is invalid: {name} is {meaning} (an int >= 1).")
