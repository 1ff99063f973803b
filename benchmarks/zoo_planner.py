"""Planner predictions against measured throughput on the space zoo, with default settings.

For each space of ``zoo_spaces.py`` and each round: calibrate in a fresh process
(``profile_supernet`` on the first batch's ``pipeline_input`` with the module's own optimizer,
plus ``lightning_overheads`` and ``pipeline_overheads``: this machine's run costs, measured now),
then measure the zoo's ``1 device`` (plain ``pl.Trainer()``) and ``2 stages``
(``NASPipeStrategy()``, every default) runs, and predict both with
:func:`lightning_naspipe.planning.simulate`: the plain run as one stage at window 1, the
2-stage run at the strategy's default window with the split the run chose. The table gives the
median of the rounds' predictions, measurements and errors. Run from the repository root::

    python benchmarks/zoo_planner.py                     # 6 spaces, 2 rounds; ~20 min on 2 cores
    python benchmarks/zoo_planner.py --spaces wide_mlp charlm --repeats 3
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
from typing import Any

import torch

import lightning_naspipe as lnp
from common import add_common_args, launch, machine, ok, ran_as_worker, rate, write_json
from lightning_naspipe.planning import SpaceSpec, profile_supernet, simulate
from lightning_naspipe.space.supernet import supernet_of
from overhead_harness import lightning_overheads, pipeline_overheads
from zoo import BASE, STAGES, run
from zoo_spaces import SPACES, Space, space

#: The strategy's default window, which the zoo's 2-stage runs use.
WINDOW = inspect.signature(lnp.NASPipeStrategy).parameters["window"].default


def worker(cfg: dict[str, Any]) -> None:
    """Calibrate one space on this machine; write its :class:`SpaceSpec` as JSON to ``cfg["out"]``."""
    chosen = space(cfg["space"], cfg["quick"])
    module = chosen.model()
    batch = next(iter(chosen.data(1)))
    sample = module.pipeline_input(batch)
    configured = module.configure_optimizers()
    template = configured if isinstance(configured, torch.optim.Optimizer) else configured["optimizer"]

    def optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return type(template)(params, **template.defaults)  # the module's own optimizer and settings

    net = supernet_of(module)
    features = max(1, batch[0][0].numel()) if isinstance(batch, (list, tuple)) else 1
    overheads = {**lightning_overheads(chosen.batch, features), **pipeline_overheads(net, sample)}
    spec = profile_supernet(net, sample, optimizer=optimizer, **overheads)
    with open(cfg["out"], "w") as f:
        f.write(spec.to_json())


def calibrate(chosen: Space, quick: bool) -> SpaceSpec | str:
    """The space's spec, calibrated in a fresh process; an error message if that failed."""
    result = launch(__file__, {"space": chosen.name, "quick": quick})
    return result["error"] if not ok(result) else SpaceSpec.from_json(json.dumps(result))


def predict(spec: SpaceSpec, chosen: Space, split: list[int]) -> dict[str, float]:
    """Subnets/s of the plain run and of the 2-stage run on ``split``, as the planner predicts them."""
    timed = chosen.subnets - chosen.warmup
    return {BASE: simulate(spec, 1, 1, subnets=timed).subnets_per_s,
            STAGES: simulate(spec, 2, WINDOW, chunks=chosen.chunks, balance=split, subnets=timed).subnets_per_s}


def one_round(chosen: Space, quick: bool) -> dict[str, Any]:
    """Calibrate, measure both configurations, predict them; or ``{"error": ...}``."""
    spec = calibrate(chosen, quick)
    if isinstance(spec, str):
        return {"error": f"calibration: {spec}"}
    measured = {name: run(chosen, name, quick) for name in (BASE, STAGES)}
    bad = [f"{name}: {r['error']}" for name, r in measured.items() if not ok(r)]
    if bad:
        return {"error": "; ".join(bad)}
    split = measured[STAGES]["split"]
    return {"split": split, "predicted": predict(spec, chosen, split),
            "measured": {name: rate(r) for name, r in measured.items()},
            "overheads": {k: getattr(spec, k) for k in ("subnet_overhead_ms", "step_overhead_ms", "message_ms",
                                                        "message_cpu_ms", "parallel_slowdown", "sync_ms")}}


def report(found: dict[str, list[dict[str, Any]]]) -> None:
    """Median prediction, measurement and error per space and configuration."""
    print(f"\n{'space':<14}{'configuration':<11}{'predicted/s':>13}{'measured/s':>12}{'error':>8}   rounds' errors")
    for name, rounds in found.items():
        good = [r for r in rounds if "error" not in r]
        for config in (BASE, STAGES):
            if not good:
                print(f"{name:<14}{config:<11}{'failed':>13}")
                continue
            errors = [r["predicted"][config] / r["measured"][config] - 1 for r in good]
            print(f"{name:<14}{config:<11}{statistics.median(r['predicted'][config] for r in good):>13.2f}"
                  f"{statistics.median(r['measured'][config] for r in good):>12.2f}{statistics.median(errors):>+8.0%}"
                  f"   {' '.join(f'{e:+.0%}' for e in errors)}")
        for r in rounds:
            if "error" in r:
                print(f"  {name}: failed round: {r['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spaces", nargs="+", choices=list(SPACES), default=list(SPACES), help="which spaces")
    parser.add_argument("--quick", action="store_true", help="the zoo's smaller models")
    add_common_args(parser)
    parser.set_defaults(repeats=2)  # rounds
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    print(f"zoo planner accuracy, default settings (window {WINDOW}); {machine()}")
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in args.spaces}
    for r in range(args.repeats):
        for name in args.spaces:
            result = one_round(space(name, args.quick), args.quick)
            found[name].append(result)
            shown = result.get("error") or ", ".join(
                f"{c} {result['predicted'][c]:.2f} predicted / {result['measured'][c]:.2f} measured"
                for c in (BASE, STAGES))
            print(f"[round {r + 1}/{args.repeats}] {name}: {shown}", flush=True)
    report(found)
    write_json(args.json, found)


if __name__ == "__main__":
    main()
