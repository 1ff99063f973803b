"""Lookahead across windows: the zoo's spaces on 2 stages with ``lookahead`` on (the default) and off.

For each space of ``zoo_spaces.py`` and each round, in a rotated order: the plain 1-device Trainer,
``NASPipeStrategy()`` on 2 stages, and ``NASPipeStrategy(lookahead=False)`` on 2 stages, every other
setting the default (as in ``zoo.py``). Ratios are taken within a round; the table gives the median
and best over the rounds, and ``gain``, lookahead on over off. Run from the repository root::

    python benchmarks/lookahead.py --spaces charlm wide_mlp wide_mlp_8ms --repeats 2
    python benchmarks/lookahead.py --quick      # smaller models, fewer subnets; < 2 min
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from common import add_common_args, launch, machine, ran_as_worker, rate, ratio, write_json
from zoo import config, worker
from zoo_spaces import SPACES, space

CONFIGS = ("1 device", "lookahead", "no lookahead")


def run(name: str, space_name: str, quick: bool) -> Any:
    cfg = config(space(space_name, quick), quick, 0 if name == "1 device" else 2)
    cfg["lookahead"] = name == "lookahead"
    return launch(__file__, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spaces", nargs="+", choices=list(SPACES), default=list(SPACES))
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer subnets")
    add_common_args(parser)
    parser.set_defaults(repeats=2)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    print(f"lookahead on and off, 2 stages, default settings otherwise; {machine()}")
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in args.spaces}
    for r in range(args.repeats):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        for name in args.spaces:
            results = {c: run(c, name, args.quick) for c in order}
            found[name].append(results)
            print(f"[round {r + 1}/{args.repeats}] {name}: "
                  + ", ".join(f"{c} {rate(results[c]):.2f}" for c in CONFIGS) + " subnets/s", flush=True)

    def median(values: list[float]) -> float:
        kept = [v for v in values if not math.isnan(v)]
        return statistics.median(kept) if kept else float("nan")

    print(f"\n{'space':<14}{'on/1 dev':>10}{'best':>7}{'off/1 dev':>11}{'best':>7}{'gain':>8}{'best':>7}")
    summary = {}
    for name, rounds in found.items():
        on = [ratio(r["lookahead"], r["1 device"]) for r in rounds]
        off = [ratio(r["no lookahead"], r["1 device"]) for r in rounds]
        gain = [ratio(r["lookahead"], r["no lookahead"]) for r in rounds]
        summary[name] = {"on": on, "off": off, "gain": gain}
        print(f"{name:<14}{median(on):>9.2f}x{max(on):>6.2f}x{median(off):>10.2f}x{max(off):>6.2f}x"
              f"{median(gain):>7.2f}x{max(gain):>6.2f}x")
    write_json(args.json, {"machine": machine(), "rounds": found, "summary": summary})


if __name__ == "__main__":
    main()
