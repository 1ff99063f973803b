"""Scheduler and bookkeeping overhead at window 32, as a share of the measured step time.

Two measurements on the character-LM space of ``space_sweep.py`` (32 candidates by default):

1. Direct timing of everything a stage does per window besides compute and communication, the
   same calls the engine makes: sampling and validating 32 subnets, their resources on every
   stage, the CSP schedule (``build_schedule``), the transport's send orders, splitting batches,
   and per subnet the update's bookkeeping (resources, parameter list, narrowing the optimizer's
   param groups) and the keyed RNG around each block. Divided by the window's wall time measured
   on 2 stages (and by the one-device time of the same 32 subnets).
2. cProfile of a one-stage ``NASPipeStrategy(window=32)`` run in this process: the *self* time
   of the package's Python code (its own frames, not the torch kernels they call), over the run.
   Profiling slows Python calls, so this overstates the share.

Run::

    python benchmarks/overhead.py              # default model
    python benchmarks/overhead.py --quick      # smaller, < 2 min
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from common import Result, add_common_args, launch, machine, ok, plot, write_json
from lightning_naspipe.space.boundary import backward_through, cut, leaf_grads
from lightning_naspipe.schedule.schedules import scheduling_resources
from lightning_naspipe.pipeline.runtime.microbatch import split_batch
from lightning_naspipe.pipeline.runtime.optim import resource_parameters, restrict_param_groups
from lightning_naspipe.pipeline.sampling.keyed import keyed_rng
from lightning_naspipe.schedule.schedules import build_schedule
from space_sweep import CharLM, model_args, text_loader

SPACE_SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "space_sweep.py")
PACKAGE = os.path.dirname(os.path.abspath(lnp.__file__))


def median_us(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn()`` in microseconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bookkeeping(module: CharLM, ranges: list[range], window: int, chunks: int, seq: int,
                reps: int) -> dict[str, float]:
    """µs per window of each non-compute part, on the busier stage where it differs."""
    supernet = module.supernet
    batches = list(text_loader(window * 16, seq, 16))
    optimizer = module.configure_optimizers()  # over every parameter, as the engine's optimizer is
    archs = [supernet.validate(module.sample_subnet(i)) for i in range(window)]
    resources = [[supernet.resources(blocks, a) for blocks in ranges] for a in archs]
    schedule = build_schedule(scheduling_resources("csp", resources), chunks)

    def update_bookkeeping(stage: int) -> None:
        for arch in archs:
            params = resource_parameters(supernet.resource_state(r)
                                         for r in sorted(supernet.resources(ranges[stage], arch)))
            with restrict_param_groups(optimizer, params):
                pass  # the optimizer's math is compute, not bookkeeping
            for p in params:
                p.grad = None

    def rng(stage: int) -> None:
        for k in range(window):
            for block in ranges[stage]:
                for c in range(chunks):
                    with keyed_rng(torch.device("cpu"), 0, k, block, c):
                        pass

    parts = {
        "sample + validate subnets": lambda: [supernet.validate(module.sample_subnet(i)) for i in range(window)],
        "resources per stage": lambda: [[supernet.resources(b, a) for b in ranges] for a in archs],
        "CSP schedule (build_schedule)": lambda: build_schedule(scheduling_resources("csp", resources), chunks),
        "transport send orders": lambda: [schedule.sends(s, d) for s in range(len(ranges))
                                          for d in ("forward", "backward")],
        "split batches": lambda: [split_batch(b, chunks) for b in batches],
    }
    out = {name: median_us(fn, reps) for name, fn in parts.items()}
    out["update bookkeeping (32 subnets)"] = max(median_us(lambda: update_bookkeeping(s), reps)
                                                 for s in range(len(ranges)))
    out["keyed RNG per block (32 subnets)"] = max(median_us(lambda: rng(s), reps) for s in range(len(ranges)))
    return out


def boundary_cost(module: CharLM, seq: int, batch: int, reps: int) -> dict[str, float]:
    """µs of one subnet's forward + backward through every block: one autograd graph (0.1) against
    a gradient boundary at every block (what the engine runs, see ``boundary.py``)."""
    supernet = module.supernet
    x, y = next(iter(text_loader(batch, seq, batch)))
    arch = supernet.validate(module.sample_subnet(0))
    blocks = range(len(supernet))

    def one_graph() -> None:
        h = x
        for i in blocks:
            h = supernet.run_block(i, h, arch)
        module.compute_loss(h, (x, y)).backward()

    def per_block() -> None:
        h, saved = x, []
        for i in blocks:
            h_in = cut(h) if i else h
            h = supernet.run_block(i, h_in, arch)
            saved.append((h_in, h))
        module.compute_loss(h, (x, y)).backward()
        for n in range(len(saved) - 2, -1, -1):
            backward_through(saved[n][1], leaf_grads(saved[n + 1][0]))

    for fn in (one_graph, per_block):  # warm up
        fn()
    graph, boundary = [], []
    for _ in range(reps):  # alternate, so a slower phase of the machine hits both alike
        graph.append(median_us(one_graph, 1))
        boundary.append(median_us(per_block, 1))
    supernet.zero_grad(set_to_none=True)
    one, per = statistics.median(graph), statistics.median(boundary)
    return {"one graph": one, "block boundaries": per, "per block": (per - one) / (len(supernet) - 1)}


def profile_share(args: argparse.Namespace) -> tuple[float, float, list[tuple[str, float]]]:
    """Self time of the package's and Lightning's Python frames over a one-stage window run."""
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)  # keep the report readable
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    module = CharLM(args.candidates, args.layers, args.width, args.seq)
    data = text_loader(args.subnets * args.batch, args.seq, args.batch)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=lnp.NASPipeStrategy(window=args.window),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    trainer.fit(module, data)
    total = time.perf_counter() - start
    profiler.disable()
    summary: Any = pstats.Stats(profiler)  # typeshed lacks .stats: {(file, line, name): (.., .., self, cum, ..)}
    stats = summary.stats
    ours = [(f"{os.path.basename(f)}:{name}", tt) for (f, _, name), (_, _, tt, _, _) in stats.items()
            if f.startswith(PACKAGE)]
    lightning = sum(tt for (f, _, _), (_, _, tt, _, _) in stats.items() if f"{os.sep}pytorch_lightning{os.sep}" in f)
    ours.sort(key=lambda item: -item[1])
    return sum(tt for _, tt in ours) / total, lightning / total, ours[:6]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, default=32)
    model_args(parser)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer subnets")
    parser.add_argument("--plot", default="docs/overhead.png")
    parser.add_argument("--boundary-only", action="store_true", help="only the per-block boundary cost")
    add_common_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.subnets = 4, 64, 96
    torch.set_num_threads(1)  # as in every stage process
    pl.seed_everything(0, verbose=False)
    module = CharLM(args.candidates, args.layers, args.width, args.seq)
    half = args.layers // 2 + 1
    ranges = [range(0, half), range(half, args.layers + 2)]
    boundary = boundary_cost(module, args.seq, args.batch, reps=50)
    print(f"gradient boundary at every block: {boundary['per block']:.1f} us per block ({boundary['one graph']:.0f} us "
          f"one graph, {boundary['block boundaries']:.0f} us with boundaries, per subnet of {len(module.supernet)} "
          f"blocks: {100 * (boundary['block boundaries'] / boundary['one graph'] - 1):+.1f}%)")
    if args.boundary_only:
        return
    parts = bookkeeping(module, ranges, args.window, args.chunks, args.seq, reps=20)
    base = {k: getattr(args, k) for k in ("candidates", "layers", "width", "seq", "batch", "subnets", "warmup",
                                           "window", "chunks")}
    nas = {**base, "shared_io": False, "schedule": "csp", "balance": [half, args.layers + 2 - half]}
    pipe: Result = launch(SPACE_SWEEP, {**nas, "stages": 2, "processes": 2}, args.repeats)
    single: Result = launch(SPACE_SWEEP, {**nas, "stages": 0, "processes": 1}, args.repeats)
    if not (ok(pipe) and ok(single)):
        raise SystemExit(f"a timed run failed: {pipe.get('error') or single.get('error')}")
    window_us = args.window / pipe["subnets_per_s"] * 1e6
    single_us = args.window / single["subnets_per_s"] * 1e6
    print(f"space: char LM, {args.candidates} candidates, {args.layers} layers, width {args.width}, batch "
          f"{args.batch}; window {args.window}, chunks {args.chunks}; {machine()}")
    print(f"step time of one window of {args.window} subnets: {window_us / 1e3:.1f} ms on 2 stages (csp), "
          f"{single_us / 1e3:.1f} ms on 1 device\n")
    print(f"{'bookkeeping per window and stage':<36}{'us':>10}{'% 2-stage step':>16}{'% 1-device step':>17}")
    for name, us in [*parts.items(), ("total", sum(parts.values()))]:
        print(f"{name:<36}{us:>10.0f}{100 * us / window_us:>15.2f}%{100 * us / single_us:>16.2f}%")
    share, lightning, top = profile_share(args)
    print(f"\ncProfile, 1 stage, window {args.window}: package Python self time {100 * share:.2f}% of the run "
          f"(Lightning's own loop {100 * lightning:.2f}%); top package functions:")
    for name, tt in top:
        print(f"  {name:<48}{tt * 1e3:>9.1f} ms")
    write_json(args.json, {"boundary_us": boundary, "parts_us": parts, "window_us": window_us, "single_us": single_us,
                           "profile_share": share, "lightning_share": lightning})

    def render(ax: Any) -> None:
        names = list(parts)
        ax.barh(range(len(names)), [100 * parts[n] / window_us for n in names], color="tab:orange")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("% of the 2-stage step time (one window)")
        ax.axvline(2.0, color="red", lw=0.8, ls="--", label="2% target")
        ax.legend(fontsize=8, loc="lower right")

    plot(args.plot, render, f"bookkeeping per window of {args.window}, total "
         f"{100 * sum(parts.values()) / window_us:.2f}% of the step ({machine(short=True)})")


if __name__ == "__main__":
    main()
