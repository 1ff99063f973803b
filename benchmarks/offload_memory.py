"""How much of a stage's partition must be on the device with ``offload=True``?

For spaces of 4..48 candidates per choice block, trains on 2 stages (window 16, Adam, so the
optimizer state counts too) and reports each stage's peak device-resident bytes (parameters,
buffers, optimizer state and gradients of what is in flight or prefetched) against the stage's
whole partition (parameters, buffers and optimizer state of all its blocks). Then the throughput
cost of offload on CPU. Run from the repository root::

    python benchmarks/offload_memory.py
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from common import Result, add_common_args, fit_timed, launch, machine, naspipe_strategy, ok, ran_as_worker
from common import write_json
from overlap import WideSpace, config, space_args, wide_loader


class AdamWideSpace(WideSpace):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def worker(cfg: dict[str, Any]) -> None:
    module = AdamWideSpace(cfg["candidates"], cfg["blocks"], cfg["width"])
    fit_timed(module, wide_loader(cfg["subnets"] * cfg["batch"], cfg["width"], cfg["batch"]), cfg,
              naspipe_strategy(cfg), cfg["stages"])


def run(args: argparse.Namespace, offload: bool, **overrides: Any) -> Result:
    cfg = config(argparse.Namespace(**{**vars(args), **overrides}), args.stages, args.window)
    result = launch(__file__, {**cfg, "offload": offload}, args.repeats)
    if not ok(result):
        raise SystemExit(f"offload_memory: {cfg} failed: {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    space_args(parser)
    parser.set_defaults(width=128, batch=32, subnets=96, warmup=16)
    parser.add_argument("--sweep", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2)
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    print(f"{args.stages} stages, window {args.window}, {args.blocks} choice blocks of width {args.width}, Adam; "
          f"{machine(short=True)}")
    print(f"{'candidates':>10}" + "".join(f"{f'stage {s} peak / partition':>28}" for s in range(args.stages)))
    sweep = {}
    for candidates in args.sweep:
        metrics = run(args, True, candidates=candidates)["metrics"]
        sweep[candidates] = metrics
        cells = []
        for s in range(args.stages):
            peak, part = metrics[f"offload/peak_device_bytes_stage{s}"], metrics[f"offload/partition_bytes_stage{s}"]
            cells.append(f"{peak / 2**20:8.2f} / {part / 2**20:7.2f} MiB {100 * peak / part:5.1f}%")
        print(f"{candidates:>10}" + "".join(f"{c:>28}" for c in cells))
    on, off = (run(args, offload, width=384, batch=64) for offload in (True, False))
    print(f"throughput at {args.candidates} candidates, width 384: offload off {off['subnets_per_s']:.2f} subnets/s, "
          f"on {on['subnets_per_s']:.2f} subnets/s ({on['subnets_per_s'] / off['subnets_per_s']:.2f}x); "
          f"prefetch hits {on['metrics']['offload/prefetch_hits_stage0']:.0f}, misses "
          f"{on['metrics']['offload/prefetch_misses_stage0']:.0f}, stalled "
          f"{on['metrics']['offload/stall_seconds_stage0']:.3f} s on stage 0")
    write_json(args.json, {"sweep": sweep, "on": on, "off": off})


if __name__ == "__main__":
    main()
