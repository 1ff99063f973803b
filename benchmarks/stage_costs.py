"""Where a subnet's time goes on each stage: every engine call timed in the run (ms per subnet).

    python benchmarks/stage_costs.py --stages 2     # NASPipeStrategy(window=8) on 2 stage processes
    python benchmarks/stage_costs.py --stages 0     # the plain one-device Trainer
    python benchmarks/stage_costs.py --chunks 2     # as the layouts benchmark runs the zoo

Wraps the executor's forward/backward, the update, the transport's send and receive (pack, isend or the
shared-memory write, irecv, unpack, the wait) and the per-window collectives with ``perf_counter``
accumulators, and prints each rank's ms per subnet (docs/benchmarks.md, section 6). The wrappers add
about a microsecond a call.

It also splits each stage's waits for its neighbours by *conflict distance*: how many subnets back the
latest earlier subnet sharing a resource with it on an earlier stage is (0: none within 8). Waits at distance
1 are CSP's own (the earlier stage must update the shared candidate before it can forward the next subnet);
waits spread over all distances point at the schedule or the split.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import defaultdict
from typing import Any

import pytorch_lightning
import torch

import lightning_naspipe as lnp
import lightning_naspipe.pipeline.runtime.engine as engine
import lightning_naspipe.pipeline.runtime.executor as executor
import lightning_naspipe.integration.preemption as preemption
import lightning_naspipe.transport.shm_links as shm_links
import lightning_naspipe.space.supernet as supernet
import lightning_naspipe.transport.torch_links as torch_links
import lightning_naspipe.transport.p2p as transport
import lightning_naspipe.transport.wire as wire
from common import add_common_args, fit_timed, launch, ran_as_worker
from zoo_spaces import SPACES, space

SECONDS: defaultdict[str, float] = defaultdict(float)
CALLS: defaultdict[str, int] = defaultdict(int)
#: Per received message: (global subnet, seconds waited); and per global subnet, its resources per stage.
WAITS: list[tuple[int, float]] = []
RESOURCES: dict[int, list[frozenset[Any]]] = {}
STAGE: list[int] = [0]
FARTHEST = 8


def timed(owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its time to ``SECONDS[key]``."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - start
            CALLS[key] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    for owner, name, key in [
        (engine.Engine, "run_window", "run_window"), (engine, "plan_window", "plan_window"),
        (executor.StageExecutor, "_forward", "F"), (executor.StageExecutor, "_backward", "B"),
        (engine.Engine, "update", "U"), (supernet.Supernet, "run_block", "F.run_block"),
        (executor, "backward_through", "B.backward_through"), (torch_links.TorchLinks, "send", "send"),
        (shm_links.SharedMemoryLinks, "send", "send"), (wire, "pack", "send.pack"),
        (transport.dist, "isend", "send.isend"), (transport.P2PTransport, "_recv", "recv (with wait)"),
        (transport.dist, "irecv", "recv.irecv"), (torch_links.TorchLinks, "_await", "recv.await"),
        (shm_links.SharedMemoryLinks, "_read_note", "recv.await"), (wire, "unpack", "recv.unpack"),
        (transport.P2PTransport, "end_window", "end_window"),
        (transport.P2PTransport, "share_window_end", "share_window_end"),
        (preemption.SigtermAgreement, "agree", "sigterm_agree"),
        (torch.optim.SGD, "step", "U.sgd_step"),
        (pytorch_lightning.core.optimizer.LightningOptimizer, "step", "U.lightning_step"),
    ]:
        timed(owner, name, key)
    watch_waits()
    started: list[float] = []

    def garbage_collector(phase: str, info: Any) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        else:
            key = f"gc gen{info['generation']}"
            SECONDS[key] += time.perf_counter() - started.pop()
            CALLS[key] += 1

    gc.callbacks.append(garbage_collector)


def watch_waits() -> None:
    """Record each receive's wait with its subnet, and each window's resources (for :func:`waits_by_distance`)."""
    receive, run_window = transport.P2PTransport._recv_for, engine.Engine.run_window

    def recv_for(self: Any, link: str, stage: int, key: tuple[int, int]) -> Any:
        before = self.wait_s
        try:
            return receive(self, link, stage, key)
        finally:
            WAITS.append((key[0], self.wait_s - before))

    def window(self: Any, module: Any, plan: Any) -> Any:
        STAGE[0] = self.stage
        for k, per_stage in enumerate(plan.resources):
            RESOURCES[plan.window.first_index + k] = per_stage
        return run_window(self, module, plan)

    transport.P2PTransport._recv_for = recv_for  # type: ignore[method-assign]
    engine.Engine.run_window = window  # type: ignore[method-assign]


def waits_by_distance(stage: int, warmup: int) -> dict[str, float]:
    """Seconds this ``stage`` waited for messages of each subnet after ``warmup``, by the subnet's conflict distance."""
    def distance(i: int) -> int:
        for d in range(1, FARTHEST + 1):
            if i - d in RESOURCES and any(RESOURCES[i][s] & RESOURCES[i - d][s] for s in range(stage)):
                return d
        return 0

    found: defaultdict[str, float] = defaultdict(float)
    for subnet, seconds in WAITS:
        if subnet >= warmup and subnet in RESOURCES:
            found[str(distance(subnet))] += seconds
    return dict(found)


def worker(cfg: dict[str, Any]) -> None:
    instrument()
    chosen = space(cfg["space"], False)
    strategy: Any = lnp.NASPipeStrategy(window=cfg["window"], chunks=cfg["chunks"]) if cfg["stages"] else "auto"
    fit_timed(chosen.model(), chosen.data(cfg["subnets"]), cfg, strategy, max(cfg["stages"], 1))
    report = {key: (SECONDS[key] / cfg["subnets"] * 1e3, CALLS[key]) for key in SECONDS}
    for d, seconds in sorted(waits_by_distance(STAGE[0], cfg["warmup"]).items(), key=lambda item: int(item[0])):
        report[f"wait, conflict distance {d}"] = (seconds / (cfg["subnets"] - cfg["warmup"]) * 1e3, 0)
    with open(f"{cfg['outdir']}.rank{os.environ.get('RANK', 0)}", "w") as f:
        json.dump(report, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--space", default="wide_mlp_8ms", choices=list(SPACES))
    parser.add_argument("--stages", type=int, default=2, help="0: the plain one-device Trainer")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1, help="micro-batches per subnet (with --stages >= 1)")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    chosen = space(args.space, False)
    out = f"/tmp/stage_costs_{args.space}_{args.stages}.json"
    cfg = {"space": chosen.name, "stages": args.stages, "processes": max(args.stages, 1), "subnets": chosen.subnets,
           "warmup": chosen.warmup, "batch": chosen.batch, "window": args.window,
           "chunks": args.chunks, "outdir": out}
    result = launch(__file__, cfg)
    print(f"{result.get('subnets_per_s', float('nan')):.2f} subnets/s steady state {result.get('error', '')}")
    for rank in range(max(args.stages, 1)):
        print(f"rank {rank}:")
        with open(f"{out}.rank{rank}") as f:
            for key, (ms, calls) in sorted(json.load(f).items()):
                print(f"  {key:22s} {ms:8.3f} ms/subnet" + (f"  ({calls} calls)" if calls else ""))


if __name__ == "__main__":
    main()
