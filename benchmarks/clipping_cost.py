"""What exact global-norm gradient clipping costs: the zoo's spaces, clipping on and off, side by side.

For each space of ``zoo_spaces.py`` and each round, in a rotated order: the plain 1-device Trainer and
``NASPipeStrategy()`` on 2 stages (every default, as in ``zoo.py``), each without clipping and with
``Trainer(gradient_clip_val=1.0)`` (norm clipping). On one device clipping costs the norm and the
multiply; on 2 stages each update also waits for the other stage's gradients of its subnet and
exchanges the per-tensor norms (``lightning_naspipe.pipeline.exactness.grad_norm``), so the last stage's update of a
subnet comes after the first stage's backward of it. Ratios are taken within a round; the table gives
the medians of ``clip / no clip`` (throughput) on each side and the milliseconds a subnet gains. First,
the exchange alone: two stage processes with the strategy's default links (shared memory) run
``NormExchange.agree`` back to back, each stage holding ``--norms`` gradients' norms, and give the
microseconds per exchange (the messages, packing and the total at stage 0; none of the waiting). Run
from the repository root::

    python benchmarks/clipping_cost.py --spaces charlm wide_mlp --repeats 2
    python benchmarks/clipping_cost.py --quick      # smaller models, fewer subnets; a few minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import lightning_naspipe as lnp
from lightning_naspipe.schedule.actions import UPDATE, Action, Schedule
from lightning_naspipe.pipeline.exactness.grad_norm import NormExchange, StageNorms
from lightning_naspipe.transport.p2p import P2PTransport
from common import add_common_args, fit_timed, launch, machine, ok, ran_as_worker, rate, rotated_rounds, write_json
from zoo import config
from zoo_spaces import SPACES, space

CLIP = 1.0
CONFIGS = ("1 device", "1 device, clip", "2 stages", "2 stages, clip")


def exchange_worker(cfg: dict[str, Any]) -> None:
    """Two stage processes: ``cfg["exchanges"]`` norm exchanges of ``cfg["norms"]`` norms a stage; rank 0 writes
    the microseconds per exchange (median over 5 windows)."""
    dist.init_process_group("gloo")
    stage, count = dist.get_rank(), cfg["exchanges"]
    transport = P2PTransport(stage, [0, 1], torch.device("cpu"), timedelta(seconds=60))
    updates = tuple(Action(UPDATE, i) for i in range(count))
    norms = [torch.rand(()) for _ in range(cfg["norms"])]
    keys = [(stage * len(norms) + n, n) for n in range(len(norms))]
    record = StageNorms.local(stage, keys, norms, by_optimizer=True, length=len(norms), max_norm=1.0)
    times = []
    for window in range(6):
        transport.begin_window(Schedule((updates, updates), {}, {}, norms=True), window * count)
        start = time.perf_counter()
        for i in range(count):
            NormExchange(transport, stage, 2, window * count + i, torch.device("cpu")).agree(record)
        times.append((time.perf_counter() - start) / count * 1e6)
        transport.end_window()
    if stage == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"us_per_exchange": statistics.median(times[1:]), "subnets_per_s": 0.0}, f)
    transport.close()
    dist.destroy_process_group()


def worker(cfg: dict[str, Any]) -> None:
    if cfg.get("exchanges"):
        exchange_worker(cfg)
        return
    chosen = space(cfg["space"], cfg["quick"])
    strategy: Any = lnp.NASPipeStrategy(chunks=chosen.chunks) if cfg["stages"] else "auto"
    fit_timed(chosen.model(), chosen.data(cfg["subnets"]), cfg, strategy, max(cfg["stages"], 1),
              gradient_clip_val=cfg["clip"])


def run(name: str, space_name: str, quick: bool) -> Any:
    cfg = config(space(space_name, quick), quick, 2 if name.startswith("2") else 0)
    cfg["clip"] = CLIP if name.endswith("clip") else None
    return launch(__file__, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spaces", nargs="+", choices=list(SPACES), default=list(SPACES))
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer subnets")
    parser.add_argument("--norms", type=int, nargs="+", default=[8, 64, 512], help="norms a stage, exchange timing")
    add_common_args(parser)
    parser.set_defaults(repeats=2)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    print(f"Trainer(gradient_clip_val={CLIP}) against none, 1 device and 2 stages, defaults otherwise; {machine()}")
    exchange = {}
    for norms in args.norms:
        result = launch(__file__, {"exchanges": 200, "norms": norms, "processes": 2})
        exchange[norms] = result.get("us_per_exchange", result.get("error"))
        print(f"norm exchange, 2 stages, {norms} norms a stage: {exchange[norms]} us", flush=True)
    found = rotated_rounds(CONFIGS, args.spaces, args.repeats, lambda c, name: run(c, name, args.quick))
    print(f"\n{'space':<14}{'1 dev clip/no':>14}{'+ms/subnet':>12}{'2 st clip/no':>14}{'+ms/subnet':>12}"
          f"{'2 st/1 dev':>12}{'with clip':>11}")
    summary: dict[str, Any] = {}
    for name, rounds in found.items():
        good = [r for r in rounds if all(ok(r[c]) for c in CONFIGS)]
        if not good:
            print(f"{name:<14}failed: {[r[c].get('error') for r in rounds for c in CONFIGS if not ok(r[c])][:1]}")
            continue

        def median(numerator: str, denominator: str, rounds: list[dict[str, Any]] = good) -> float:
            return statistics.median(rate(r[numerator]) / rate(r[denominator]) for r in rounds)

        def extra_ms(clipped: str, plain: str, rounds: list[dict[str, Any]] = good) -> float:
            return statistics.median(1e3 / rate(r[clipped]) - 1e3 / rate(r[plain]) for r in rounds)

        summary[name] = row = {
            "one_device_clip_over_none": median("1 device, clip", "1 device"),
            "one_device_ms": extra_ms("1 device, clip", "1 device"),
            "stages_clip_over_none": median("2 stages, clip", "2 stages"),
            "stages_ms": extra_ms("2 stages, clip", "2 stages"),
            "stages_over_one_device": median("2 stages", "1 device"),
            "stages_over_one_device_clipped": median("2 stages, clip", "1 device, clip"),
            "rounds": good,
        }
        print(f"{name:<14}{row['one_device_clip_over_none']:>13.2f}x{row['one_device_ms']:>12.2f}"
              f"{row['stages_clip_over_none']:>13.2f}x{row['stages_ms']:>12.2f}"
              f"{row['stages_over_one_device']:>11.2f}x{row['stages_over_one_device_clipped']:>10.2f}x")
    if args.json:
        write_json(args.json, {"machine": machine(), "clip": CLIP, "quick": args.quick, "exchange_us": exchange,
                               "spaces": summary})


if __name__ == "__main__":
    main()
