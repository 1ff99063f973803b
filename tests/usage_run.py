"""Runs scenarios of usage_scenarios.py under NASPipeStrategy in this stage process; used by
test_usage_stages.py, which starts one process per stage (torchrun's variables).

Rank 0 saves each scenario's result to ``OUT/<index>.result``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from usage_scenarios import SCENARIOS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=None, help="stages (the other processes: replicas)")
    parser.add_argument("scenarios", nargs="+", help="names in usage_scenarios.SCENARIOS")
    args = parser.parse_args()
    out = Path(args.out)
    for index, name in enumerate(args.scenarios):
        folder = out / str(index)
        result = SCENARIOS[name](
            lambda: lnp.NASPipeStrategy(window=args.window, num_stages=args.num_stages, timeout=60), folder)
        if os.environ.get("RANK", "0") == "0":
            torch.save(result, out / f"{index}.result")


if __name__ == "__main__":
    main()
