"""What one run of a stage's actions uses besides the executor's fixed parts (the module, the blocks, the
transport): every optional collaborator of a window, in one place, absent (``None``, ``False``) where the
window does without it.

The engine builds one per training window (and one per evaluation forward); the executor reads it and never
asks whether a collaborator exists anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_naspipe.pipeline.exactness.replicas import ReplicaUpdates
from lightning_naspipe.pipeline.exactness.ties import TieRoutes
from lightning_naspipe.pipeline.offload.residency import WindowResidency
from lightning_naspipe.pipeline.runtime.telemetry import StageTelemetry

__all__ = ["StageRun"]


@dataclass(frozen=True)
class StageRun:
    """The optional collaborators of one run of a stage's actions.

    Attributes:
        chunk_offset: the first micro-batch this replica trains (:meth:`.Layout.chunk_share`): action chunk
            ``c`` is micro-batch ``chunk_offset + c`` of the subnet's batch.
        ties: how this stage moves the values and gradients of parameters tied across stages (:mod:`.ties`);
            ``None`` when no parameter spans stages.
        replicas: with several replicas per stage, this replica's part of their exact reduction.
        telemetry: records the actions' timeline.
        defer_weight_grads: send a backward's input gradients before computing its weight gradients
            (see :mod:`.weight_grads`); never on the first stage, which sends none.
        residency: with offload, the window's prefetch before a subnet's first forward on this stage and
            release after its update.
    """

    chunk_offset: int = 0
    ties: TieRoutes | None = None
    replicas: ReplicaUpdates | None = None
    telemetry: StageTelemetry | None = None
    defer_weight_grads: bool = False
    residency: WindowResidency | None = None
