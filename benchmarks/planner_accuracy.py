"""Planner predictions against measured throughput, on ``overlap.py``'s wide space.

Each round calibrates on this machine (``profile_supernet`` + ``lightning_overheads`` +
``pipeline_overheads``, ~20 s), predicts 1 device, 2 stages at window 1 and 2 stages at
window 16 with :func:`lightning_naspipe.planning.simulate`, then measures the same three
configurations (``overlap.py``'s runs, fresh processes each). Rounds alternate calibrating and
measuring, so a machine whose speed drifts moves both; the table reports the median of the
rounds (and their range). Run from the repository root::

    python benchmarks/planner_accuracy.py              # 3 rounds, ~5 min on 2 cores
    python benchmarks/planner_accuracy.py --rounds 1   # one round
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch

from common import Result, add_common_args, launch, machine, ok, write_json
from lightning_naspipe.planning import SpaceSpec, profile_supernet, simulate
from overhead_harness import lightning_overheads, pipeline_overheads
from overlap import CONFIGS, WideSpace, config, space_args

OVERLAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap.py")
RUN_OVERHEADS = ("step_overhead_ms", "subnet_overhead_ms", "message_ms", "message_cpu_ms", "parallel_slowdown",
                 "sync_ms")


def calibrate(args: argparse.Namespace) -> SpaceSpec:
    """The space's costs and this machine's run overheads, measured now (one intra-op thread)."""
    torch.set_num_threads(1)
    module = WideSpace(args.candidates, args.blocks, args.width)
    x = torch.randn(args.batch, args.width)
    overheads = {**lightning_overheads(args.batch, args.width), **pipeline_overheads(module.supernet, x)}

    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)  # as WideSpace trains

    return profile_supernet(module.supernet, x, optimizer=sgd, **overheads)


def predict(spec: SpaceSpec, args: argparse.Namespace) -> dict[str, float]:
    """Subnets/s of each configuration, as the planner predicts it."""
    timed = args.subnets - args.warmup
    return {name: simulate(spec, max(stages, 1), window, subnets=timed).subnets_per_s
            for name, stages, window in CONFIGS}


def compute_only(spec: SpaceSpec) -> SpaceSpec:
    """The same space without the run's overheads (Lightning, messages, shared cores)."""
    return SpaceSpec(spec.blocks, update_ms=spec.update_ms, action_overhead_ms=spec.action_overhead_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    space_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help="calibrate-then-measure rounds; medians are reported")
    add_common_args(parser)
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        spec = calibrate(args)
        measured: dict[str, Result] = {name: launch(OVERLAP, config(args, stages, window), args.repeats)
                                       for name, stages, window in CONFIGS}
        bad = [f"{name}: {res['error']}" for name, res in measured.items() if not ok(res)]
        if bad:
            raise SystemExit("planner_accuracy: a measurement failed: " + "; ".join(bad))
        rounds.append({"predicted": predict(spec, args), "compute_only": predict(compute_only(spec), args),
                       "measured": {name: res["subnets_per_s"] for name, res in measured.items()},
                       "overheads": {k: getattr(spec, k) for k in RUN_OVERHEADS}})
        print(f"round {r + 1}: " + ", ".join(f"{name} {rounds[-1]['predicted'][name]:.1f} predicted / "
                                             f"{rounds[-1]['measured'][name]:.1f} measured" for name, _, _ in CONFIGS))
    print(f"\nspace: {args.blocks} choice blocks x {args.candidates} candidates, width {args.width}, "
          f"batch {args.batch};"
          f" {machine()}; median (range) of {args.rounds} rounds, subnets/s")
    print(f"{'configuration':<22}{'predicted':>20}{'measured':>20}{'error':>8}{'compute-only':>15}")
    for name, _, _ in CONFIGS:
        cells = []
        for key in ("predicted", "measured"):
            values = [rnd[key][name] for rnd in rounds]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        errors = [rnd["predicted"][name] / rnd["measured"][name] - 1 for rnd in rounds]
        only = statistics.median(rnd["compute_only"][name] / rnd["measured"][name] - 1 for rnd in rounds)
        print(f"{name:<22}{cells[0]:>20}{cells[1]:>20}{statistics.median(errors):>+8.0%}{only:>+15.0%}")
    overheads = {k: statistics.median(rnd["overheads"][k] for rnd in rounds) for k in RUN_OVERHEADS}
    print("calibrated run overheads (medians): " + ", ".join(f"{k} {v:.3g}" for k, v in overheads.items()))
    write_json(args.json, rounds)


if __name__ == "__main__":
    main()
