"""Command line: ``python -m lightning_naspipe <command> ...``.

Commands:
    plan: predict throughput, bubbles, stall causes and in-flight depth for several stage counts, or
        for every stages x replicas layout of ``--processes N`` (naming the best), from a space spec
        (``SpaceSpec.to_json``) or a synthetic wide space (``--wide C``).
    latency: measure a :class:`~lightning_naspipe.LatencyTable` of a model's supernet on this machine, save it, and
        report its predictions' error against end-to-end measured latency on a sample of architectures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

import torch

from lightning_naspipe.searching.latency import LatencyTable
from lightning_naspipe.space.supernet import supernet_of

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.planning import SpaceSpec, plan, table, wide_spec
from lightning_naspipe.planning.links import LINKS
from lightning_naspipe.planning.nodes import DEFAULT_LINKS
from lightning_naspipe.planning.planner import best_layout, plan_layouts
from lightning_naspipe.schedule.schedules import SCHEDULES


def _plan(args: argparse.Namespace) -> int:
    if (args.spec is None) == (args.wide is None):
        print("plan: give exactly one of --spec FILE or --wide CANDIDATES", file=sys.stderr)
        return 2
    if args.spec is not None:
        with open(args.spec) as f:
            spec = SpaceSpec.from_json(f.read())
    else:
        spec = wide_spec(args.wide, args.blocks, args.block_ms)
    settings = dict(subnets=args.subnets, seed=args.seed, batch_size=args.batch_size, lookahead=not args.no_lookahead,
                    defer_weight_grads=args.defer_weight_grads)
    steps = args.subnets_per_step
    if steps < 1:
        print(f"plan: --subnets-per-step must be >= 1, got {steps}", file=sys.stderr)
        return 2
    if args.nodes is not None and (args.processes is None or args.nodes < 1 or args.processes % args.nodes):
        print(f"plan: --nodes {args.nodes} needs --processes P that it divides (every node runs P / N processes), "
              f"got --processes {args.processes}; give --processes a multiple of {args.nodes}", file=sys.stderr)
        return 2
    if args.processes is not None:
        nodes = dict(nodes=args.nodes, links=LINKS[args.links]) if args.nodes is not None else {}
        predictions = plan_layouts(spec, args.processes, args.window, args.chunks, args.schedule, steps, **settings,
                                   **nodes)
        if not predictions:
            print(f"plan: no layout of {args.processes} processes fits chunks={args.chunks} x {steps} subnet(s) per "
                  "step (a multiple of the replicas) and the space's blocks", file=sys.stderr)
            return 2
    else:
        predictions = plan(spec, args.stages, args.window, args.chunks, args.schedule, steps, **settings)
    if args.json:
        print(json.dumps([p.to_dict() for p in predictions], indent=1))
        return 0
    skipped = [s for s in args.stages if s > len(spec.blocks)] if args.processes is None else []
    space = f"{len(spec.blocks)} blocks, {len(spec.labels())} choices" if args.spec else (
        f"wide: {args.blocks} choice blocks x {args.wide} candidates, {args.block_ms} ms forward per block")
    print(f"space: {space}; window {args.window}, chunks {args.chunks}, schedule {args.schedule}, "
          f"lookahead {'off' if args.no_lookahead else 'on'}, "
          f"{predictions[0].subnets if predictions else 0} {'subnets' if steps == 1 else 'steps'} simulated")
    if steps > 1:
        print(f"each training step trains {steps} subnets: the rates count steps")
    one_device = plan(spec, [1], args.window, args.chunks, args.schedule, steps, **settings)[0].subnets_per_s
    print(table(predictions, one_device))
    if args.processes is not None:
        best = best_layout(predictions)
        where = f" on {args.nodes} nodes ({args.links})" if args.nodes is not None else ""
        print(f"best layout for {args.processes} processes{where}: {best.stages} stage(s) x {best.replicas} "
              f"replica(s), NASPipeStrategy(num_stages={best.stages}, chunks={args.chunks})")
    if skipped:
        print(f"skipped stage counts {skipped}: more stages than the space's {len(spec.blocks)} blocks")
    print("bubble: idle share of stage time, split by cause: depen(dency) = a forward held for an earlier subnet's "
          "update (CSP); data = waiting for a neighbour's activation or gradient (fill/drain); commu(nication) = one "
          "in flight; order = work ready but later in the engine's fixed order; overh(ead) = fixed per-window costs")
    return 0


def _latency(args: argparse.Namespace) -> int:
    module_name, _, class_name = args.model.partition(":")
    if not module_name or not class_name:
        print(f"latency: --model takes package.module:Class, got {args.model!r}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_class = getattr(importlib.import_module(module_name), class_name)
    torch.manual_seed(args.seed)  # the timing does not depend on the weights' values, but make them the same
    supernet = supernet_of(model_class(**json.loads(args.init_args))).to(args.device)
    example = torch.randn(*(int(n) for n in args.input_shape.split(",")), device=args.device)
    table = LatencyTable.measure(supernet, example, args.repeats)
    print(f"latency table of {len(table.entries)} blocks on {table.device}, batch size {table.batch_size}, "
          f"{torch.get_num_threads()} thread(s): predictions from {table.fastest_ms():.4f} to "
          f"{table.slowest_ms():.4f} ms; saved to {table.save(args.output)}")
    if args.error_samples > 0:
        print(table.error(supernet, example, samples=args.error_samples, seed=args.seed, repeats=args.repeats))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lightning_naspipe", description="NASPipe tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="predict pipeline throughput for several stage counts",
                            description="Simulate the CSP schedule on a space's costs (see docs/planner.md).")
    p.add_argument("--spec", help="a SpaceSpec JSON file (lightning_naspipe.planning.profile_supernet(...).to_json())")
    p.add_argument("--wide", type=int, metavar="C", help="instead of --spec: choice blocks of C equal candidates")
    p.add_argument("--blocks", type=int, default=8, help="with --wide: the number of choice blocks (default 8)")
    p.add_argument("--block-ms", type=float, default=1.0,
                   help="with --wide: forward ms per block (backward is twice that; default 1.0)")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--processes", type=int, default=None,
                   help="instead of --stages: every stages x replicas layout of this many processes, and the best")
    p.add_argument("--nodes", type=int, default=None,
                   help="with --processes: the nodes they span; stage messages and the replicas' reduction that "
                        "cross nodes take --links' inter-node link")
    p.add_argument("--links", choices=sorted(LINKS), default=DEFAULT_LINKS,
                   help=f"with --nodes: the links within and between nodes (default {DEFAULT_LINKS!r})")
    p.add_argument("--window", type=int, default=8, help="training steps per window (default 8, as NASPipeStrategy)")
    p.add_argument("--chunks", type=int, default=1, help="micro-batches per subnet (default 1)")
    p.add_argument("--schedule", choices=SCHEDULES, default="csp")
    p.add_argument("--subnets", type=int, default=None, help="subnets to simulate (default 64, whole windows)")
    p.add_argument("--subnets-per-step", type=int, default=1,
                   help="subnets each training step trains (lnp.Sandwich(2): 4; default 1)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per subnet, for samples/s")
    p.add_argument("--no-lookahead", action="store_true",
                   help="as NASPipeStrategy(lookahead=False): every window drains before the next starts")
    p.add_argument("--defer-weight-grads", choices=[True, False], type=lambda v: {"on": True, "off": False}[v],
                   default=None, metavar="{on,off}",
                   help="as NASPipeStrategy(defer_weight_grads=...): on/off; default: the engine's measured choice "
                        "on the spec's input- and weight-pass times")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.set_defaults(run=_plan)
    q = commands.add_parser("latency", help="measure a latency lookup table on this machine and its error",
                            description="Time every candidate of a model's supernet in place, save the "
                                        "LatencyTable, and compare its predictions with end-to-end latency.")
    q.add_argument("--model", required=True, help="package.module:Class of a module with a .supernet (or a Supernet)")
    q.add_argument("--init-args", default="{}", help="the class's keyword arguments as JSON (default {})")
    q.add_argument("--input-shape", required=True, help="the example input's shape, e.g. 32,3,16,16 (batch first)")
    q.add_argument("--repeats", type=int, default=10, help="timed runs per measurement, median kept (default 10)")
    q.add_argument("--output", default="latency.json", help="where to save the table (default latency.json)")
    q.add_argument("--error-samples", type=int, default=20,
                   help="architectures to compare predictions with measured latency on (0: none; default 20)")
    q.add_argument("--seed", type=int, default=0, help="the weights' and the sample's seed (default 0)")
    q.add_argument("--device", default="cpu", help="where to measure, e.g. cpu or cuda:0 (default cpu)")
    q.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    q.set_defaults(run=_latency)
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
    except (ValueError, OSError, ImportError, AttributeError, NASPipeConfigError) as error:
        print(f"{args.command}: {error}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
