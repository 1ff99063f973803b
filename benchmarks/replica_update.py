"""Where a data-parallel update's time goes on this machine: what calibrates the replicas' costs in ``CPU_OVERHEADS``.

Each space trains with ``NASPipeStrategy(chunks=2, num_stages=1)`` on 2 processes (1 stage x 2 replicas), the
replicas' update timed from inside (``ReplicaUpdates.reduce``, the streamed sum, the BatchNorm statistics and their
replay), and, in a process of its own, is profiled as ``num_stages="auto"`` profiles it. Per update it prints:

* ``skew``: how far apart the two replicas reach the update, mean |difference| (the earlier one waits);
* ``sum``: the streamed gradient sum on the replica that arrives last (nothing left to wait for);
* ``stats``: the statistics exchange on that replica, less the replay (``replay``: on the later replica);
* ``steady``: milliseconds per subnet after ``--warmup`` steps.

and what they make of the planner's constants (``lightning_naspipe/planning/replica_update.py``): ``spread`` (skew
over the expected |difference| of two normal draws and the compute), and the per-tensor costs of gradients and
statistics (exchange time beyond the link model's bytes, over the tensors and the 2 hops)::

    python benchmarks/replica_update.py                     # spos (16 channels), nb201, mobilenet; ~4 min
    python benchmarks/replica_update.py --spaces spos --steps 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from common import Clock, launch, machine, ran_as_worker
from lightning_naspipe.pipeline.exactness import replicas as exact

SPACES = ("spos", "nb201", "mobilenet", "wide_mlp")


def model_and_data(space: str, steps: int) -> tuple[pl.LightningModule, Any, Any]:
    """The module, the data for ``steps`` subnets, and the first batch's pipeline input."""
    if space == "spos":
        from spos_cnn import SposCNN, random_images
        module, data = SposCNN(16, 2), random_images(steps * 32, 32)
    else:
        from zoo_spaces import SPACES as ZOO
        chosen = ZOO[space](False)
        module, data = chosen.model(), chosen.data(steps)
    loader = data.train_dataloader() if hasattr(data, "train_dataloader") else data
    return module, data, module.pipeline_input(next(iter(loader)))


class _Timed:
    """Wraps the replicas' update steps with timers (this process only)."""

    def __init__(self) -> None:
        self.enter: dict[int, float] = {}
        self.sums: list[float] = []
        self.stats: list[float] = []
        self.replay = 0.0
        updates = exact.ReplicaUpdates
        reduce, reduce_statistics = updates.reduce, updates._reduce_statistics
        streamed, replay = exact.streamed_sum, exact.replay_statistics

        def timed_reduce(updates: Any, index: int, *args: Any) -> None:
            self.enter[index] = time.perf_counter()
            reduce(updates, index, *args)

        def timed(into: list[float], call: Any) -> Any:
            def run(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    into.append(time.perf_counter() - start)
            return run

        def timed_replay(layer: Any, batch: Any) -> None:
            start = time.perf_counter()
            replay(layer, batch)
            self.replay += time.perf_counter() - start

        exact.ReplicaUpdates.reduce = timed_reduce  # type: ignore[method-assign]
        exact.streamed_sum = timed(self.sums, streamed)
        exact.ReplicaUpdates._reduce_statistics = timed(self.stats, reduce_statistics)  # type: ignore[method-assign]
        exact.replay_statistics = timed_replay


def worker(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    if cfg["profile"]:
        profile(cfg)
        return
    timed, clock = _Timed(), Clock(cfg["warmup"])
    module, data, _ = model_and_data(cfg["space"], cfg["steps"])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lnp.NASPipeStrategy(chunks=2, num_stages=1),
                         max_steps=cfg["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock])
    trainer.fit(module, data)
    skip, rank = cfg["warmup"], trainer.global_rank
    mine = {"enter": timed.enter, "sum": timed.sums[skip:], "stats": timed.stats[skip:],
            "replay": timed.replay / max(1, len(timed.stats)), "steady": clock.elapsed / max(1, clock.subnets)}
    with open(f"{cfg['out']}.{rank}", "w") as f:
        json.dump(mine, f)
    if rank == 0:  # both ranks' records, as launch() reads one result
        while not os.path.exists(f"{cfg['out']}.1"):
            time.sleep(0.05)
        time.sleep(0.2)
        with open(f"{cfg['out']}.1") as f:
            other = json.load(f)
        with open(cfg["out"], "w") as f:
            json.dump({"ranks": [mine, other]}, f)


def profile(cfg: dict[str, Any]) -> None:
    """The profile ``num_stages="auto"`` takes, one process: compute, tensors and bytes of a uniform subnet."""
    from lightning_naspipe.integration.auto_layout import CPU_OVERHEADS
    from lightning_naspipe.integration.startup import ENGINE_SECONDS
    from lightning_naspipe.planning.profile import profile_share, spec_of
    from lightning_naspipe.space.boundary import map_tensors
    from lightning_naspipe.space.supernet import supernet_of

    module, _, x = model_and_data(cfg["space"], 8)
    micro = map_tensors(lambda t: t[: t.shape[0] // 2], x)
    net = supernet_of(module)
    spec = spec_of(net, [profile_share(net, micro, deferred=False, engine_seconds=ENGINE_SECONDS)])
    spec = dataclasses.replace(spec.compute_scaled(lambda ms: ms * 2), **CPU_OVERHEADS)

    def mean(field: Any) -> float:
        return sum(statistics.fmean(field(c) for c in b.candidates) for b in spec.blocks)

    found = {"compute_ms": mean(lambda c: c.forward_ms + c.backward_ms) / 2,
             "replay_ms": mean(lambda c: c.replay_ms) / 2,
             "grad_tensors": mean(lambda c: c.grad_tensors), "statistics_tensors": mean(lambda c: c.statistics_tensors),
             "grad_mb": mean(lambda c: c.grad_bytes) / 1e6, "hop_ms": spec.message_ms + spec.message_cpu_ms,
             "ms_per_mb": spec.message_ms_per_mb}
    with open(cfg["out"], "w") as f:
        json.dump(found, f)


def measure(space: str, steps: int, warmup: int) -> dict[str, float]:
    run = launch(__file__, {"space": space, "steps": steps, "warmup": warmup, "profile": False, "processes": 2})
    model = launch(__file__, {"space": space, "profile": True})
    if "error" in run or "error" in model:
        raise RuntimeError(f"{space}: {run.get('error') or model.get('error')}")
    ranks = run["ranks"]
    first, second = ranks
    gaps = [second["enter"][k] - first["enter"][k] for k in list(first["enter"])[warmup:] if k in second["enter"]]
    last = second if statistics.median(gaps) > 0 else first  # the replica that reaches the update last
    later = ranks[1]
    skew = statistics.fmean(abs(g) for g in gaps) * 1000
    summed = statistics.median(last["sum"]) * 1000
    stats = statistics.median(last["stats"]) * 1000 if last["stats"] else 0.0  # no BatchNorm: no exchange
    replay = later["replay"] * 1000
    exchange = stats - (replay if last is first else 0.0)  # the first replica's stats include waiting for the replay
    hops = 2
    bytes_ms = hops * (model["hop_ms"] + model["grad_mb"] * model["ms_per_mb"])
    grad_tensor_ms = max(0.0, summed - bytes_ms) / (hops * model["grad_tensors"])
    statistics_tensor_ms = (max(0.0, exchange) / (hops * model["statistics_tensors"])
                            if model["statistics_tensors"] else math.nan)
    spread = skew / 2 / (0.589 * model["compute_ms"])  # E|a - b| / 2 = E[max] - mean; Blom's E[max of 2] = 0.589
    return {"steady": ranks[0]["steady"] * 1000, "skew": skew, "sum": summed, "stats": exchange, "replay": replay,
            "model_replay": model["replay_ms"], "compute": model["compute_ms"], "grad_tensors": model["grad_tensors"],
            "statistics_tensors": model["statistics_tensors"], "spread": spread, "grad_tensor_ms": grad_tensor_ms,
            "statistics_tensor_ms": statistics_tensor_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spaces", nargs="+", default=list(SPACES), choices=SPACES,
                        help="spos: SposCNN(16, 2) at batch 32; the others: the zoo's (benchmarks/zoo_spaces.py)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    print(f"{machine()}; 1 stage x 2 replicas, chunks 2, {args.steps} steps; per update, ms", flush=True)
    print(f"{'space':<10}{'steady':>8}{'compute':>9}{'skew':>7}{'sum':>7}{'stats':>7}{'replay':>8}{'(profile)':>10}"
          f"{'tensors g/s':>13}{'spread':>8}{'ms/grad t':>10}{'ms/stat t':>10}")
    for space in args.spaces:
        r = measure(space, args.steps, args.warmup)
        print(f"{space:<10}{r['steady']:>8.1f}{r['compute']:>9.1f}{r['skew']:>7.2f}{r['sum']:>7.2f}{r['stats']:>7.2f}"
              f"{r['replay']:>8.2f}{r['model_replay']:>10.2f}{r['grad_tensors']:>7.0f}/{r['statistics_tensors']:<5.0f}"
              f"{r['spread']:>8.3f}{r['grad_tensor_ms']:>10.4f}{r['statistics_tensor_ms']:>10.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
