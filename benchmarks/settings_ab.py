"""A strategy setting against the default: the zoo's spaces on 2 stages, side by side in one run.

For each space of ``zoo_spaces.py`` and each round, in a rotated order: the plain 1-device Trainer,
``NASPipeStrategy()`` on 2 stages, and ``NASPipeStrategy(**setting)`` on 2 stages for each ``--setting``,
every other setting the default (as in ``zoo.py``). Ratios are taken within a round; the table gives the
median and best over the rounds of each configuration against 1 device, and ``gain``, the default over each
setting. Run from the repository root::

    python benchmarks/settings_ab.py --setting lookahead=False --spaces charlm wide_mlp --repeats 2
    python benchmarks/settings_ab.py --setting defer_weight_grads=False defer_weight_grads=True --spaces mobilenet
    python benchmarks/settings_ab.py --setting lookahead=False --quick      # smaller models; < 2 min
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
from typing import Any

from common import add_common_args, launch, machine, ran_as_worker, ratio, rotated_rounds, write_json
from zoo import config, worker
from zoo_spaces import SPACES, space

BASE, DEFAULT = "1 device", "default"


def parse_setting(text: str) -> dict[str, Any]:
    """``"name=value"`` (a Python literal) as ``{name: value}``."""
    name, _, value = text.partition("=")
    if not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, e.g. lookahead=False; got {text!r}")
    return {name: ast.literal_eval(value)}


def run(name: str, space_name: str, quick: bool) -> Any:
    cfg = config(space(space_name, quick), quick, 0 if name == BASE else 2)
    cfg["settings"] = {} if name in (BASE, DEFAULT) else parse_setting(name)
    return launch(__file__, cfg)


def median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", nargs="+", default=[], help="NAME=VALUE of NASPipeStrategy, per configuration")
    parser.add_argument("--spaces", nargs="+", choices=list(SPACES), default=list(SPACES))
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer subnets")
    add_common_args(parser)
    parser.set_defaults(repeats=2)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    if not args.setting:
        parser.error("name at least one --setting NAME=VALUE, e.g. --setting lookahead=False")
    for text in args.setting:
        parse_setting(text)
    configs = (BASE, DEFAULT, *args.setting)
    print(f"{', '.join(args.setting)} against the default, 2 stages, default settings otherwise; {machine()}")
    found = rotated_rounds(configs, args.spaces, args.repeats, lambda c, name: run(c, name, args.quick))
    print(f"\n{'space':<14}{'configuration':<34}{'/1 device':>10}{'best':>7}{'default/it':>12}{'best':>7}")
    summary: dict[str, Any] = {}
    for name, rounds in found.items():
        summary[name] = {}
        for c in configs[1:]:
            vs_base = [ratio(r[c], r[BASE]) for r in rounds]
            gain = [ratio(r[DEFAULT], r[c]) for r in rounds]
            summary[name][c] = {"vs_1_device": vs_base, "default_over_it": gain}
            print(f"{name:<14}{c:<34}{median(vs_base):>9.2f}x{max(vs_base):>6.2f}x"
                  + (f"{median(gain):>11.2f}x{max(gain):>6.2f}x" if c != DEFAULT else ""))
    write_json(args.json, {"machine": machine(), "rounds": found, "summary": summary})


if __name__ == "__main__":
    main()
