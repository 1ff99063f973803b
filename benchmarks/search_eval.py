"""Search evaluation throughput: ``lnp.search`` on 1 process against 2 processes (gloo, 1 thread each).

The zoo's NB201 cell space on digits (fresh weights: evaluation speed does not depend on them) is
searched with ``RandomSearch(128)`` over the same evaluation batches, with and without BatchNorm
recalibration, after a short untimed warm-up search in every process; the 2-process run must give
the same records, and the table gives architectures/s and the ratio (best of ``--repeats`` rounds).
Run from the repository root::

    python benchmarks/search_eval.py --repeats 3   # ~1.5 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from zoo_spaces import digits_loader, nb201_model  # noqa: E402


def _run(rank: int, world: int, init: str | None, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    if init is not None:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nb201_model(args.channels)
    loader = digits_loader(args.batches, args.batch)
    calibration = digits_loader(2, args.batch) if args.calibrate else None
    lnp.search(None, model, lnp.RandomSearch(4, seed=99), loader, calibration=calibration)  # warm-up
    if init is not None:
        dist.barrier()
    start = time.perf_counter()
    result = lnp.search(None, model, lnp.RandomSearch(args.samples, seed=1), loader, calibration=calibration)
    seconds = time.perf_counter() - start
    if rank == 0:
        results[world] = (seconds, result.history)
    if init is not None:
        dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> tuple[float, list[Any]]:
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        # Fresh processes for both, so that neither run inherits this process's state.
        init = f"file://{folder}/rendezvous" if world > 1 else None
        mp.spawn(_run, args=(world, init, args, results), nprocs=world, join=True)
        return results[world]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| calibration | 1 process (arch/s) | 2 processes (arch/s) | ratio | same records |")
    print("|---|---|---|---|---|")
    for calibrate in (False, True):
        args.calibrate = calibrate
        one = two = float("inf")
        for _ in range(args.repeats):
            seconds, one_history = measure(1, args)
            one = min(one, seconds)
            seconds, two_history = measure(2, args)
            two = min(two, seconds)
        print(f"| {'2 batches' if calibrate else 'none'} | {args.samples / one:.1f} | {args.samples / two:.1f} | "
              f"{one / two:.2f}x | {one_history == two_history} |")


if __name__ == "__main__":
    main()
