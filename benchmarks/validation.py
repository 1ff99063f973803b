"""Validation throughput: ``trainer.validate`` with the mixin's default ``validation_step`` on 1 process, 2 stages
and 2 replicas (``NASPipeStrategy()`` / ``NASPipeStrategy(num_stages=1)``).

Validation evaluates one batch at a time, as Lightning's loop hands them out: on stages each batch flows through the
pipeline and its output comes back to every stage, so that the user's metric code runs unchanged on every rank; this
measures what the pipeline adds per batch. Replicas shard the batches (``integration/eval_shards.py``): each runs
the forward of one batch of every group of two and the outputs are exchanged, so 2 replicas / 1 process is the
speed-up sharding gives (at most 2x; the exchange and Lightning's per-batch loop, run on every rank, are the rest),
and ``2 unsharded`` (replicas that each evaluate every batch, as before) what it gains over not sharding.
Each configuration validates the space's model twice in fresh processes and times the second pass; rounds alternate
the configurations. Run from the repository root::

    python benchmarks/validation.py                         # wide_mlp_8ms and nb201, 2 rounds
    python benchmarks/validation.py --spaces charlm --repeats 3
    python benchmarks/validation.py --configs "1 process" "2 replicas" "2 unsharded" --batches 50   # sharding
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import pytorch_lightning as pl

import lightning_naspipe as lnp
from common import add_common_args, launch, machine, ran_as_worker
from zoo_spaces import SPACES, space

CONFIGS: dict[str, tuple[int, int | None]] = {"1 process": (1, None), "2 stages": (2, None), "2 replicas": (2, 1),
                                              "2 unsharded": (2, 1)}
#: Replicas that each evaluate every batch, as before sharding: what sharding gains, on the same machine and run.
UNSHARDED = "2 unsharded"


class EpochTimer(pl.Callback):
    """Seconds of the last validation epoch."""

    def __init__(self) -> None:
        self.start, self.seconds = 0.0, 0.0

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start


def worker(cfg: dict[str, Any]) -> None:
    chosen = space(cfg["space"])
    processes, num_stages = CONFIGS[cfg["config"]]
    if cfg["config"] == UNSHARDED:
        from lightning_naspipe.integration.eval_shards import EvalShards

        EvalShards.output = lambda *args: None  # type: ignore[method-assign,assignment]  # every call unsharded
    timer = EpochTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=lnp.NASPipeStrategy(num_stages=num_stages),
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    module, data = chosen.model(), chosen.data(cfg["batches"])
    trainer.validate(module, data, verbose=False)  # warm-up
    trainer.validate(module, data, verbose=False)
    if trainer.global_rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"batches_per_s": cfg["batches"] / timer.seconds}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spaces", nargs="+", default=["wide_mlp_8ms", "nb201"], choices=list(SPACES))
    parser.add_argument("--batches", type=int, default=200, help="validation batches per pass (default 200)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help=f"the layouts to run (default all; the ratios need '1 process'; {UNSHARDED!r}: 2 replicas "
                             "that each evaluate every batch, as before sharding)")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    args.repeats = max(args.repeats, 2)
    configs = [c for c in CONFIGS if c in args.configs]
    ratios = [c for c in configs if c != "1 process" and "1 process" in configs]
    print(f"{machine()}; batches/s of the second of two validation passes, median of {args.repeats} rounds")
    print(f"{'space':14s}" + "".join(f"{c:>16s}" for c in configs) + "".join(f"   {c} / 1 process" for c in ratios))
    for name in args.spaces:
        rates: dict[str, list[float]] = {c: [] for c in configs}
        for r in range(args.repeats):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for config in order:
                result = launch(__file__, {"space": name, "config": config, "processes": CONFIGS[config][0],
                                           "batches": args.batches})
                rates[config].append(result.get("batches_per_s", float("nan")))
        medians = {c: statistics.median(v) for c, v in rates.items()}
        print(f"{name:14s}" + "".join(f"{medians[c]:16.1f}" for c in configs)
              + "".join(f"   {medians[c] / medians['1 process']:>{len(c) + 12}.2f}x" for c in ratios), flush=True)


if __name__ == "__main__":
    main()
