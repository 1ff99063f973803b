"""Layouts side by side: the space zoo with ``chunks=2`` everywhere on 1 device, 2 stages and 2 replicas.

Each space of ``zoo_spaces.py`` is trained with default settings but ``chunks=2`` (so that two replicas
can share every batch), in four configurations that give bitwise the same result:

- ``1 device``: ``NASPipeStrategy(chunks=2)`` on one process (the sequential engine);
- ``2 stages``: ``NASPipeStrategy(chunks=2)`` on 2 processes, one stage each (S=2, D=1);
- ``2 replicas``: ``NASPipeStrategy(chunks=2, num_stages=1)`` on 2 processes (S=1, D=2);
- ``auto``: ``NASPipeStrategy(chunks=2, num_stages="auto")`` on 2 processes, and the layout it chose.

Beside each measurement, the planner's prediction: what ``num_stages="auto"`` computes (the supernet
profiled on the first batch's ``pipeline_input``, the CPU overheads of ``integration/auto_layout.py``), in a
process of its own before the rounds. Rounds rotate the order of the configurations; ratios are taken within a
round against its 1-device run, and the table gives medians over ``--repeats`` rounds. Run from the repository
root::

    python benchmarks/layouts.py                      # every zoo space, 3 rounds
    python benchmarks/layouts.py --quick --repeats 1  # smaller models, fewer subnets
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from typing import Any

import lightning_naspipe as lnp
from common import add_common_args, fit_timed, launch, machine, ok, ran_as_worker, rate, ratio, rotated_rounds
from common import write_json
from unseen_spaces import UNSEEN
from zoo_spaces import SPACES

ALL_SPACES = {**SPACES, **UNSEEN}


def space(name: str, quick: bool = False) -> Any:
    """A zoo space, or one of ``unseen_spaces.py``."""
    return ALL_SPACES[name](quick)

BASE, STAGES, REPLICAS, AUTO, PREDICT = "1 device", "2 stages", "2 replicas", "auto", "predict"
CONFIGS = (BASE, STAGES, REPLICAS, AUTO)
CHUNKS = 2
#: Per configuration: processes and ``num_stages``.
LAYOUTS: dict[str, tuple[int, Any]] = {BASE: (1, None), STAGES: (2, None), REPLICAS: (2, 1), AUTO: (2, "auto"),
                                       PREDICT: (1, None)}


def worker(cfg: dict[str, Any]) -> None:
    """Train one configuration of one space (or predict them all); rank 0 writes the result and the layout used."""
    chosen = space(cfg["space"], cfg["quick"])
    if cfg["config"] == PREDICT:
        predict(chosen, cfg)
        return
    processes, num_stages = LAYOUTS[cfg["config"]]
    strategy, logged = lnp.NASPipeStrategy(chunks=cfg["chunks"], num_stages=num_stages), []
    strategy._info = logged.append  # the run's rank-zero log lines: auto's predictions
    fit_timed(chosen.model(), chosen.data(cfg["subnets"]), cfg, strategy, processes)
    if strategy.is_global_zero:
        with open(cfg["out"]) as f:
            result = json.load(f)
        layout = strategy.layout
        result["layout"] = f"S={layout.stages} D={layout.replicas}"
        found = [m.group(1) for line in logged if (m := re.search(r"chose .*per stages x replicas: (.*)$", line))]
        if found:  # its rate for the layout it chose, as it logged it
            rates = {f"{st} x {d}": float(r) for st, d, r in re.findall(r"(\d+) x (\d+): ([\d.]+)", found[0])}
            result["auto_predicted"] = rates.get(f"{layout.stages} x {layout.replicas}")
        with open(cfg["out"], "w") as f:
            json.dump(result, f)


def predict(chosen: Any, cfg: dict[str, Any]) -> None:
    """The planner's subnets/s for 1 device and every layout of 2 processes, as ``num_stages="auto"`` predicts."""
    import dataclasses

    import torch

    from lightning_naspipe.integration.auto_layout import CPU_OVERHEADS
    from lightning_naspipe.planning import profile_supernet
    from lightning_naspipe.planning.planner import plan_layouts, simulate
    from lightning_naspipe.space.supernet import supernet_of

    torch.set_num_threads(1)
    module = chosen.model()
    batch = next(iter(chosen.data(1)))
    spec = dataclasses.replace(profile_supernet(supernet_of(module), module.pipeline_input(batch), repeats=1,
                                                engine_seconds=0), **CPU_OVERHEADS)
    window = lnp.NASPipeStrategy().window
    rates = {BASE: simulate(spec, 1, window, cfg["chunks"]).subnets_per_s}
    for p in plan_layouts(spec, 2, window, cfg["chunks"]):
        rates[STAGES if p.stages == 2 else REPLICAS] = p.subnets_per_s
    with open(cfg["out"], "w") as f:
        json.dump({"subnets_per_s": rates[BASE], "predicted": rates}, f)


def run(name: str, space_name: str, quick: bool, chunks: int = CHUNKS) -> Any:
    chosen = space(space_name, quick)
    cfg = {"space": space_name, "quick": quick, "config": name, "processes": LAYOUTS[name][0], "chunks": chunks,
           "subnets": chosen.subnets, "warmup": chosen.warmup, "batch": chosen.batch}
    return launch(__file__, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--spaces", nargs="+", default=list(SPACES), choices=list(ALL_SPACES),
                        help="zoo spaces (default: all), or unseen_spaces.py's (shufflenet)")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help=f"chunks of every run (default {CHUNKS})")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer subnets")
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    predicted = {name: run(PREDICT, name, args.quick, args.chunks).get("predicted", {}) for name in args.spaces}
    rounds = rotated_rounds(CONFIGS, args.spaces, args.repeats, lambda c, s: run(c, s, args.quick, args.chunks))
    print(f"\n{machine()}; chunks={args.chunks}; {args.repeats} round(s); medians of subnets/s and of ratios to "
          "1 device; (planner's prediction)")
    print(f"{'space':<14}{'1 device/s':>18}{'2 stages':>18}{'2 replicas':>18}{'auto':>8}  auto chose, and its "
          "predicted subnets/s against that layout's measured rate")
    summary = {}
    for name, results in rounds.items():
        def median(values: list[float]) -> float:
            kept = [v for v in values if not math.isnan(v)]
            return statistics.median(kept) if kept else float("nan")

        ratios = {c: median([ratio(r[c], r[BASE]) for r in results]) for c in CONFIGS[1:]}
        chose = sorted({r[AUTO].get("layout", "-") for r in results if ok(r[AUTO])}) or ["failed"]
        summary[name] = {"base": median([rate(r[BASE]) for r in results]), **ratios, "auto_chose": chose,
                         "errors": [f"{c}: {r[c]['error']}" for r in results for c in CONFIGS if not ok(r[c])]}
        guess = predicted[name]
        base_guess = guess.get(BASE, float("nan"))

        def vs(config: str) -> str:
            return f"({guess.get(config, float('nan')) / base_guess:.2f}x)"

        summary[name]["predicted"] = guess
        # num_stages="auto"'s own prediction of the layout it chose against that layout run directly (issue 40).
        direct = {"S=2 D=1": STAGES, "S=1 D=2": REPLICAS}.get(chose[0]) if len(chose) == 1 else None
        own = median([r[AUTO]["auto_predicted"] for r in results if r[AUTO].get("auto_predicted")])
        measured = median([rate(r[direct]) for r in results]) if direct else float("nan")
        summary[name]["auto_predicted"], summary[name]["auto_layout_measured"] = own, measured
        print(f"{name:<14}{summary[name]['base']:>9.2f} ({base_guess:>5.1f}){ratios[STAGES]:>9.2f}x {vs(STAGES):>8}"
              f"{ratios[REPLICAS]:>9.2f}x {vs(REPLICAS):>8}{ratios[AUTO]:>7.2f}x  {', '.join(chose)}: "
              f"{own:.1f} against {measured:.1f} ({own / measured - 1:+.0%})")
        for error in summary[name]["errors"]:
            print(f"  failed: {error}")
    if args.json:
        write_json(args.json, {"machine": machine(), "chunks": args.chunks, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
