"""Several subnets per step with default settings: the sandwich rule (k = 4: largest, smallest, 2 uniform) on an
elastic space and on a candidate-op space, 1 device against ``NASPipeStrategy()`` on 2 stages and against
``NASPipeStrategy(num_stages=1)`` on 2 processes (2 replicas, each training 2 of a step's 4 subnets), side by side.

- ``ofa``: ``examples/ofa_digits.py``'s elastic MobileNet (elastic depth, expansion and kernel) on digits, with
  in-place distillation;
- ``mobilenet``: the zoo's MobileNetV2/ProxylessNAS candidate-op space (``zoo_spaces.py``).

Training steps per second after a warm-up (each step trains 4 subnets and steps the optimizer once); ratios within
a round, rounds rotate the order. Run from the repository root::

    python benchmarks/recipes.py --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import lightning_naspipe as lnp
from common import add_common_args, fit_timed, launch, machine, ran_as_worker, rate, ratio, rotated_rounds
from zoo_spaces import space

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

BASE, STAGES, REPLICAS = "1 device", "2 stages", "2 replicas"
SPACES = ("ofa", "mobilenet")


def build(name: str, quick: bool) -> tuple[Any, Any, int, int]:
    """The module (with ``Sandwich(2)``), a loader of ``steps`` batches, the batch size and the steps."""
    steps = 24 if quick else 64
    if name == "ofa":
        from ofa_digits import ElasticMobileNet

        return ElasticMobileNet("sandwich"), _digit_sized(steps, 64), 64, steps
    chosen = space("mobilenet", quick)
    module = chosen.model()
    module.step_sampler = lnp.Sandwich(2)
    return module, chosen.data(steps), chosen.batch, steps


def _digit_sized(steps: int, batch: int) -> Any:
    """``steps`` batches of random 1x8x8 images (digits' shape) and labels, the same in every process."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 1, 8, 8, generator=gen)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),), generator=gen)), batch_size=batch)


def worker(cfg: dict[str, Any]) -> None:
    module, data, _, _ = build(cfg["space"], cfg["quick"])
    strategy = lnp.NASPipeStrategy(num_stages=cfg.get("num_stages")) if cfg["processes"] > 1 else "auto"
    fit_timed(module, data, cfg, strategy, cfg["processes"])


def run(config: str, name: str, quick: bool) -> Any:
    _, _, batch, steps = build(name, quick)
    cfg = {"space": name, "quick": quick, "processes": 1 if config == BASE else 2, "subnets": steps,
           "warmup": 8, "batch": batch, "num_stages": 1 if config == REPLICAS else None}
    return launch(__file__, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    rounds = rotated_rounds((BASE, STAGES, REPLICAS), list(SPACES), args.repeats, lambda c, s: run(c, s, args.quick))
    print(f"\n{machine()}; sandwich k=4, default settings; medians over {args.repeats} round(s)")
    for name, results in rounds.items():
        cells = []
        for config in (STAGES, REPLICAS):
            ratios = [ratio(r[config], r[BASE]) for r in results]
            cells.append(f"{config} {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
        print(f"{name:<12} 1 device {statistics.median(rate(r[BASE]) for r in results):6.2f} steps/s, "
              + ", ".join(cells))


if __name__ == "__main__":
    main()
