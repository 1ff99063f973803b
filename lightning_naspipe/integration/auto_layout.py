"""``NASPipeStrategy(num_stages="auto")``: the stages x replicas layout the planner predicts fastest.

Results never depend on the layout (see ``docs/design.md``, "Stages x replicas"), so the choice is free.
On the first training batch the supernet is profiled on its first micro-batch (each block's candidates timed
forward and backward, :func:`~lightning_naspipe.planning.profile.profile_share`, every rank a share of them at once,
or read from the disk cache: :mod:`.startup`), the planner simulates every layout of the processes that leaves a
training step's ``subnets * chunks`` micro-batches a multiple of the replicas (:func:`~.planner.plan_layouts`; where
only one layout fits, nothing is profiled), and every rank takes rank 0's choice. The run's overheads (messages,
Lightning's per-window work) are not measured then: the planner takes the medians calibrated on a 2-core CPU host
(``docs/planner.md``), or none on CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, TypedDict

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.planning.planner import best_layout, fitting_layouts, plan_layouts
from lightning_naspipe.planning.space_spec import SpaceSpec

__all__ = ["CPU_OVERHEADS", "LayoutChoice", "Overheads", "chosen_stages", "layout_hparams"]


class Overheads(TypedDict):
    """Run overheads of a :class:`~.space_spec.SpaceSpec` (``docs/planner.md``)."""

    subnet_overhead_ms: float
    step_overhead_ms: float
    message_cpu_ms: float
    message_ms: float
    sync_ms: float
    message_ms_per_mb: float
    grad_tensor_ms: float
    statistics_tensor_ms: float
    replica_spread: float


#: The run overheads ``benchmarks/overhead_harness.py`` calibrated on a 2-core CPU host (``docs/planner.md``);
#: the replicas' costs from ``benchmarks/replica_update.py`` (:mod:`.planning.replica_update`): the per-tensor
#: costs and spread on the zoo's nb201, spos and mobilenet, ``message_ms_per_mb`` on wide_mlp (the streamed sum of
#: its 8.4 MB of gradients took 21 ms an update on 2 replicas, which :func:`.links.streamed_chain_ms` prices so).
CPU_OVERHEADS = Overheads(subnet_overhead_ms=0.22, step_overhead_ms=0.32, message_cpu_ms=0.12, message_ms=0.015,
                          sync_ms=0.38, message_ms_per_mb=1.8, grad_tensor_ms=0.007, statistics_tensor_ms=0.03,
                          replica_spread=0.13)


class LayoutChoice(NamedTuple):
    """What ``num_stages="auto"`` chose: ``stages`` (the rest of the processes are replicas), the log line, and the
    hyperparameters the loggers record (:func:`layout_hparams`)."""

    stages: int
    message: str
    hparams: dict[str, Any]


def layout_hparams(stages: int, replicas: int, how: str, rates: str | None = None,
                   predicted: float | None = None, unit: str | None = None) -> dict[str, Any]:
    """The choice as the loggers' hyperparameters, e.g. ``{"naspipe/num_stages": 2, "naspipe/replicas": 1,
    "naspipe/layout_chosen_by": "planner", "naspipe/predicted_rate": 41.3, "naspipe/predicted_rate_unit":
    "subnets/s", "naspipe/predicted_rates": "1 x 2: 38.0, 2 x 1: 41.3"}`` (the predictions only when planned).

    Args:
        stages: the chosen stages.
        replicas: the replicas of each stage.
        how: ``"planner"``, or ``"only fit"`` where one layout fits.
        rates: every layout's predicted rate, ``"S x R: rate"`` joined by commas.
        predicted: the chosen layout's predicted rate.
        unit: the rates' unit.
    """
    hparams: dict[str, Any] = {"naspipe/num_stages": stages, "naspipe/replicas": replicas,
                               "naspipe/layout_chosen_by": how}
    if predicted is not None:
        hparams.update({"naspipe/predicted_rate": round(predicted, 2), "naspipe/predicted_rate_unit": unit,
                        "naspipe/predicted_rates": rates})
    return hparams


def chosen_stages(profile: Callable[[bool], SpaceSpec], processes: int, blocks: int, chunks: int, window: int,
                  is_global_zero: bool, broadcast: Callable[[Any], Any], device_type: str, subnets: int = 1,
                  defer_weight_grads: bool | None = None, nodes: int = 1) -> LayoutChoice:
    """The number of stages for ``processes`` (the rest replicas), chosen on rank 0 and ``broadcast`` to every
    rank (collective), with a line for the log naming every layout's predicted rate and the loggers' record of it.

    Args:
        profile: ``profile(deferred)`` is the profile of one micro-batch, with the deferred backward's passes if
            ``deferred`` (called on every rank, collective), unless only one layout fits.
        processes: every rank of the run.
        blocks: the supernet's.
        chunks: micro-batches per subnet.
        window: subnets per window.
        is_global_zero: whether this is rank 0, which plans.
        broadcast: rank 0's value on every rank.
        device_type: ``"cpu"`` plans with :data:`CPU_OVERHEADS`.
        subnets: per training step (replicas share a step's ``subnets * chunks`` micro-batches, so more layouts fit).
        defer_weight_grads: ``NASPipeStrategy``'s; the profile times the passes where the plan uses them.
        nodes: the Trainer's ``num_nodes``: the plan charges what crosses nodes (:func:`.nodes.replica_view`).

    Raises:
        NASPipeConfigError: no layout of ``processes`` fits.
    """
    fits = fitting_layouts(processes, blocks, chunks * subnets)
    if not fits:
        raise NASPipeConfigError(
            f"num_stages='auto' finds no layout of {processes} processes for {blocks} blocks and {chunks * subnets} "
            "micro-batches per training step: the stages must divide the processes and be at most the blocks, and "
            "the replicas (processes / stages) must divide chunks x subnets per step. Use fewer devices or a chunks "
            "that they divide, or pass num_stages=<int>.")
    if len(fits) == 1:
        (stages, replicas), = fits
        return LayoutChoice(stages, f"NASPipe: num_stages='auto' chose {stages} stage(s) x {replicas} replica(s), the "
                                    f"only layout of {processes} processes that fits (not profiled)",
                            layout_hparams(stages, replicas, "only fit"))
    # The planner models deferred weight gradients only at chunks x subnets 1, or where they are forced on.
    spec = profile(defer_weight_grads is True or (defer_weight_grads is None and chunks * subnets == 1))
    choice: LayoutChoice | None = None
    if is_global_zero:
        spec = spec.compute_scaled(lambda ms: ms * chunks)  # one micro-batch's compute -> a subnet batch's
        if device_type == "cpu":
            spec = dataclasses.replace(spec, **CPU_OVERHEADS)
        predictions = plan_layouts(spec, processes, window, chunks, subnets_per_step=subnets,
                                   defer_weight_grads=defer_weight_grads, nodes=nodes)
        best = best_layout(predictions)
        rates = ", ".join(f"{p.stages} x {p.replicas}: {p.subnets_per_s:.1f}" for p in predictions)
        unit = "subnets/s" if subnets == 1 else f"training steps/s ({subnets} subnets each)"
        message = (f"NASPipe: num_stages='auto' chose {best.stages} stage(s) x {best.replicas} replica(s); "
                   f"predicted {unit} per stages x replicas: {rates}")
        choice = LayoutChoice(best.stages, message,
                              layout_hparams(best.stages, best.replicas, "planner", rates, best.subnets_per_s, unit))
    stages, message, hparams = broadcast(choice)
    return LayoutChoice(int(stages), str(message), dict(hparams))
