"""``NASPipeStrategy(num_stages="auto")``: the stages x replicas layout the planner predicts fastest.

Results never depend on the layout (see ``docs/design.md``, "Stages x replicas"), so the choice is free.
Rank 0 profiles the supernet on the first training batch (each block's candidates timed forward and
backward, :func:`~lightning_naspipe.planning.profile.profile_supernet`), the planner simulates every layout of
the processes that leaves a training step's ``subnets * chunks`` micro-batches a multiple of the replicas
(:func:`~.planner.plan_layouts`), and every
rank takes rank 0's choice. The run's overheads (messages, Lightning's per-window work) are not measured
then: the planner takes the medians calibrated on a 2-core CPU host (``docs/planner.md``), or none on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, TypedDict

import torch

from lightning_naspipe.planning.planner import best_layout, plan_layouts
from lightning_naspipe.planning.profile import profile_supernet
from lightning_naspipe.space.supernet import BlockValue, Supernet
from lightning_naspipe.transport.boundary import map_tensors

__all__ = ["CPU_OVERHEADS", "Overheads", "chosen_stages"]



class Overheads(TypedDict):
    """Run overheads of a :class:`~.space_spec.SpaceSpec` (``docs/planner.md``)."""

    subnet_overhead_ms: float
    step_overhead_ms: float
    message_cpu_ms: float
    message_ms: float
    sync_ms: float
    message_ms_per_mb: float


#: The run overheads ``benchmarks/overhead_harness.py`` calibrated on a 2-core CPU host (``docs/planner.md``);
#: ``message_ms_per_mb`` from the replicas' updates of ``benchmarks/layouts.py``'s wide_mlp (8 MB of gradients
#: per update cost 2 x 2 replicas ~16 ms there).
CPU_OVERHEADS = Overheads(subnet_overhead_ms=0.22, step_overhead_ms=0.32, message_cpu_ms=0.12, message_ms=0.015,
                          sync_ms=0.38, message_ms_per_mb=1.0)


def chosen_stages(supernet: Supernet, example: BlockValue, processes: int, chunks: int, window: int,
                  is_global_zero: bool, broadcast: Callable[[Any], Any], device: torch.device,
                  subnets: int = 1) -> tuple[int, str]:
    """The number of stages for ``processes`` (the rest replicas), chosen on rank 0 and ``broadcast`` to every
    rank (collective), and a line for the log naming every layout's predicted rate. ``subnets``: per training
    step (replicas share a step's ``subnets * chunks`` micro-batches, so more layouts fit)."""
    choice: tuple[int, str] | None = None
    if is_global_zero:
        whole = copy.deepcopy(supernet)  # with every block, on this rank's device
        whole.local_blocks = None
        spec = profile_supernet(whole.to(device), map_tensors(lambda t: t.to(device), example), repeats=1,
                                engine_seconds=0)
        if device.type == "cpu":
            spec = dataclasses.replace(spec, **CPU_OVERHEADS)
        predictions = plan_layouts(spec, processes, window, chunks, subnets_per_step=subnets)
        best = best_layout(predictions)
        rates = ", ".join(f"{p.stages} x {p.replicas}: {p.subnets_per_s:.1f}" for p in predictions)
        unit = "subnets/s" if subnets == 1 else f"training steps/s ({subnets} subnets each)"
        choice = (best.stages, f"NASPipe: num_stages='auto' chose {best.stages} stage(s) x {best.replicas} "
                               f"replica(s); predicted {unit} per stages x replicas: {rates}")
    stages, message = broadcast(choice)
    return int(stages), str(message)

