"""``num_stages="auto"`` against the layout it picks, run directly: what choosing costs, first run and rerun.

Issue 40: on a SPOS-style CNN at 200 steps the auto layout's start-up (profile, rebuild) ate most of its gain.
Each round trains the same space and data, 2 processes but the first, with every setting at its default but
``chunks``::

    1 device      the plain one-device Trainer with NASPipeStrategy(chunks=C) on one process
    auto, first   NASPipeStrategy(num_stages="auto"), an empty profile cache (a first run)
    auto, rerun   the same, the cache the first run wrote (a rerun or a resume)
    direct        NASPipeStrategy(num_stages=<what auto picked>): no profile, no rebuild

A time is ``trainer.fit`` on rank 0, the ranks starting the clock together (imports and process starts not
counted). Ratios are within a round; the table gives the best of ``--rounds``. Beside it, the planner's check
(issue 40, item 3): the rate the auto run predicted for the layout it picked (its log line) against the
steady-state rate (subnets per second after the first ``--warmup`` steps) of every run of that layout: both auto
runs (after the rebuild) and the direct one, the best of them (a shared 2-core machine only ever slows a run: the
same layout moved 9.6-13.2 subnets/s within one round) and their median::

    python benchmarks/auto_layout.py                     # SPOS CNN (16 channels, 2 blocks per resolution), 200 steps
    python benchmarks/auto_layout.py --steps 60 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import pytorch_lightning as pl

import lightning_naspipe as lnp
from common import Clock, every_rank_started, launch, machine, ran_as_worker
from lightning_naspipe.integration.profile_cache import ENV as CACHE_ENV
from spos_cnn import SposCNN, random_images

SCRIPT = os.path.abspath(__file__)
CONFIGS = ("1 device", "auto, first", "auto, rerun", "direct")


def worker(cfg: dict[str, Any]) -> None:
    processes = cfg["processes"]
    strategy, logged = lnp.NASPipeStrategy(chunks=cfg["chunks"], num_stages=cfg["num_stages"]), []
    strategy._info = logged.append  # the run's rank-zero log lines: the auto layout's predictions
    clock = Clock(cfg["warmup"])
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=cfg["steps"],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    module, data = SposCNN(16, 2), random_images(cfg["steps"] * 32, 32)
    every_rank_started(cfg)
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    if trainer.global_rank == 0:
        with open(cfg["out"], "w") as f:
            layout = f"{strategy.layout.stages} x {strategy.layout.replicas}"
            predicted = [float(m.group(1)) for line in logged
                         if (m := re.search(rf"{layout}: ([\d.]+)", line)) and "num_stages='auto' chose" in line]
            json.dump({"seconds": seconds, "subnets_per_s": cfg["steps"] / seconds, "stages": strategy.layout.stages,
                       "replicas": strategy.layout.replicas, "steady_subnets_per_s": clock.subnets / clock.elapsed,
                       "predicted": predicted[0] if predicted else None,
                       "startup": [line for line in logged if "setup" in line.lower() or "took" in line]}, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=40, help="steps before the steady-state clock starts")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return 0
    print(f"auto layout: {machine()}; SPOS CNN, {args.steps} steps, chunks {args.chunks}", flush=True)
    best = {config: float("inf") for config in CONFIGS}
    best_steady = {config: 0.0 for config in CONFIGS}
    picked, predicted, steady = "", [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            os.environ[CACHE_ENV] = cache
            base = {"steps": args.steps, "chunks": args.chunks, "warmup": args.warmup}
            runs = {"1 device": launch(SCRIPT, {**base, "processes": 1, "num_stages": None}),
                    "auto, first": launch(SCRIPT, {**base, "processes": 2, "num_stages": "auto"}),
                    "auto, rerun": launch(SCRIPT, {**base, "processes": 2, "num_stages": "auto"})}
            chosen = runs["auto, first"]
            if "error" in chosen:
                print(f"auto layout: the auto run failed: {chosen['error']}")
                return 1
            picked = f"{chosen['stages']} stage(s) x {chosen['replicas']} replica(s)"
            runs["direct"] = launch(SCRIPT, {**base, "processes": 2, "num_stages": chosen["stages"]})
            if chosen["predicted"] is not None:
                predicted.append(chosen["predicted"])
                steady += [runs[config]["steady_subnets_per_s"] for config in ("auto, first", "auto, rerun", "direct")
                           if "error" not in runs[config]]
        for config, result in runs.items():
            if "error" in result:
                print(f"auto layout: {config} failed: {result['error']}")
                return 1
            best[config] = min(best[config], result["seconds"])
            best_steady[config] = max(best_steady[config], result["steady_subnets_per_s"])
            if os.environ.get("AUTO_LAYOUT_VERBOSE"):
                print(f"  {config}: {result['seconds']:.2f} s, steady {result['steady_subnets_per_s']:.2f} subnets/s; "
                      f"{result['startup']}", flush=True)
    print(f"auto picked {picked}")
    for config in CONFIGS:
        print(f"  {config:12s} {best[config]:7.2f} s  {best['1 device'] / best[config]:.2f}x one device  "
              f"{best['direct'] / best[config]:.2f}x direct  (steady state {best_steady[config]:.2f} subnets/s)")
    if predicted:  # one layout fitting is chosen without a prediction
        middle = statistics.median(steady)
        print(f"planner: predicted {max(predicted):.2f} subnets/s for {picked}; its {len(steady)} runs measured "
              f"{max(steady):.2f} at steady state at best (error {max(predicted) / max(steady) - 1:+.0%}), "
              f"{middle:.2f} in the median (error {max(predicted) / middle - 1:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
