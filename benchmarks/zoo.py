"""Space zoo: a user's spaces with DEFAULT settings, one device vs ``NASPipeStrategy()`` on 2 stages.

Each space of ``zoo_spaces.py`` (NB201 cells on digits, the SPOS CNN, a MobileNetV2/ProxylessNAS
MBConv space, the char-LM transformer, two wide MLPs) is trained the way a user would first try it:

- ``1 device``: the plain ``pl.Trainer()`` (no strategy), one subnet per batch;
- ``2 stages``: ``NASPipeStrategy()`` on 2 stage processes with every default: window 8, no
  ``balance`` and no ``supernet_example_input`` (the strategy times the blocks on the first batch
  and moves to that split before the first window trains), chunks 1 (the SPOS CNN: chunks 4);
- ``pair``: two independent 1-device runs of the space started at the same time. Each one's
  subnets/s as a fraction of the solo run is what one core gives when the other is busy too, so
  2 x that fraction is the hardware's limit for 2 stages on this machine (the "pair limit").

The configurations alternate: each round runs every configuration of a space once (in a rotated
order), and a space's ratio is taken within a round; the table gives the best and the median over
``--repeats`` rounds. Throughput is steady-state subnets/s after a warm-up (``common.Clock``), each
run in fresh processes with one intra-op thread (``common.launch``). Run from the repository root::

    python benchmarks/zoo.py                                # 6 spaces, 3 rounds; ~25 min on 2 cores
    python benchmarks/zoo.py --spaces charlm spos --repeats 5
    python benchmarks/zoo.py --quick                        # smaller models, fewer subnets, 1 round; < 3 min
    python benchmarks/zoo.py --json zoo.json --plot docs/zoo.png

``--telemetry`` adds, after the timed rounds, one untimed 2-stage run per space with
``NASPipeStrategy(telemetry=True)`` and prints each stage's busy fraction (kept out of the timed runs,
where its bookkeeping could distort the numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning_naspipe as lnp
from common import Result, add_common_args, fit_timed, launch, machine, ok, plot, ran_as_worker, rate, ratio
from common import write_json
from lightning_naspipe.space.supernet import supernet_of
from zoo_spaces import SPACES, Space, candidate_counts, space

BASE, STAGES, PAIR = "1 device", "2 stages", "pair"
CONFIGS = (BASE, STAGES, PAIR)
#: One round of one space: the 1-device and 2-stage results, and the pair's two results.
Round = dict[str, Any]
#: How the 2-stage runs move messages (``--transport``; the default is the strategy's).
TRANSPORT = {"kind": "auto"}


def worker(cfg: dict[str, Any]) -> None:
    """Train one configuration of one space; rank 0 writes the result (and the 2-stage split)."""
    chosen = space(cfg["space"], cfg["quick"])
    strategy: Any = "auto"
    if cfg["stages"]:
        strategy = lnp.NASPipeStrategy(chunks=chosen.chunks, telemetry=cfg.get("telemetry", False),
                                       transport=cfg["transport"], **cfg.get("settings", {}))
    fit_timed(chosen.model(), chosen.data(cfg["subnets"]), cfg, strategy, max(cfg["stages"], 1))
    if isinstance(strategy, lnp.NASPipeStrategy) and strategy.is_global_zero:
        add_to_result(cfg["out"], split=[len(r) for r in strategy.stage_ranges])


def add_to_result(path: str, **entries: Any) -> None:
    """Add ``entries`` to the result file ``fit_timed`` wrote."""
    with open(path) as f:
        result = json.load(f)
    with open(path, "w") as f:
        json.dump({**result, **entries}, f)


def config(chosen: Space, quick: bool, stages: int, telemetry: bool = False) -> dict[str, Any]:
    """The worker configuration of one run."""
    return {"space": chosen.name, "quick": quick, "stages": stages, "processes": max(stages, 1),
            "subnets": chosen.subnets, "warmup": chosen.warmup, "batch": chosen.batch, "telemetry": telemetry,
            "transport": TRANSPORT["kind"]}


def run_together(cfgs: list[dict[str, Any]]) -> list[Result]:
    """Launch every configuration at the same time (each in its own processes); their results."""
    with ThreadPoolExecutor(len(cfgs)) as pool:
        return list(pool.map(lambda cfg: launch(__file__, cfg), cfgs))


def run(chosen: Space, name: str, quick: bool) -> Any:
    """One configuration of one space: a result, or the pair's two results."""
    if name == PAIR:
        return run_together([config(chosen, quick, 0)] * 2)
    return launch(__file__, config(chosen, quick, 2 if name == STAGES else 0))


def measure(chosen: list[Space], rounds: int, quick: bool) -> dict[str, list[Round]]:
    """``rounds`` rounds; in each, every configuration of every space once, the order rotated per round."""
    found: dict[str, list[Round]] = {s.name: [] for s in chosen}
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for s in chosen:
            results = {name: run(s, name, quick) for name in order}
            found[s.name].append(results)
            print(f"[round {r + 1}/{rounds}] {s.name}: {progress(results)}", flush=True)
    return found


def progress(results: Round) -> str:
    """One round's subnets/s, for the progress line."""
    pair = "/".join(f"{rate(p):.2f}" for p in results[PAIR])
    return f"1 device {rate(results[BASE]):.2f}, 2 stages {rate(results[STAGES]):.2f}, pair {pair} subnets/s"


def pair_fraction(results: Round) -> float:
    """The pair's mean subnets/s over the same round's solo run; NaN when a run failed."""
    pair = results[PAIR]
    if not ok(results[BASE]) or not all(ok(p) for p in pair):
        return float("nan")
    return statistics.mean(rate(p) for p in pair) / rate(results[BASE])


def summarize(rounds: list[Round]) -> dict[str, Any]:
    """Medians of the rates, best and median 2-stage ratio and pair fraction over the rounds."""
    def median(values: list[float]) -> float:
        kept = [v for v in values if not math.isnan(v)]  # drop failed runs
        return statistics.median(kept) if kept else float("nan")

    ratios = [ratio(r[STAGES], r[BASE]) for r in rounds]
    fractions = [pair_fraction(r) for r in rounds]
    splits = [r[STAGES]["split"] for r in rounds if ok(r[STAGES]) and "split" in r[STAGES]]
    return {"base": median([rate(r[BASE]) for r in rounds]), "stages": median([rate(r[STAGES]) for r in rounds]),
            "ratios": ratios, "ratio_best": max((x for x in ratios if not math.isnan(x)), default=float("nan")),
            "ratio_median": median(ratios), "pair_fractions": fractions, "pair_fraction": median(fractions),
            "splits": splits, "errors": errors(rounds)}


def errors(rounds: list[Round]) -> list[str]:
    """Every failed run's configuration and reason, once each."""
    found = []
    for results in rounds:
        for name in CONFIGS:
            for r in results[name] if name == PAIR else [results[name]]:
                if not ok(r) and f"{name}: {r['error']}" not in found:
                    found.append(f"{name}: {r['error']}")
    return found


def shape(chosen: Space) -> tuple[int, str]:
    """Blocks of the space's supernet, and candidates per choice (``"6-7"`` when they differ)."""
    module = chosen.model()
    low, high = candidate_counts(module)
    return len(supernet_of(module)), str(low) if low == high else f"{low}-{high}"


def print_report(chosen: list[Space], shapes: dict[str, tuple[int, str]], summaries: dict[str, dict[str, Any]],
                 rounds: int) -> None:
    """The zoo's table, then the failures."""
    head = (f"{'space':<14}{'blocks':>7}{'cands':>7}{'ms/subnet':>11}{'1 device/s':>12}{'2 stages/s':>12}"
            f"{'ratio best':>12}{'median':>8}{'pair frac':>11}{'pair limit':>12}  split")
    print(f"\n{rounds} round(s); subnets/s are medians over the rounds, ratios 2 stages / 1 device within a round")
    print(head)
    for s in chosen:
        blocks, cands = shapes[s.name]
        m = summaries[s.name]
        split = " ".join(sorted({str(x) for x in m["splits"]})) or "-"
        print(f"{s.name:<14}{blocks:>7}{cands:>7}{1000 / m['base']:>11.1f}{m['base']:>12.2f}{m['stages']:>12.2f}"
              f"{m['ratio_best']:>11.2f}x{m['ratio_median']:>7.2f}x{m['pair_fraction']:>11.2f}"
              f"{2 * m['pair_fraction']:>11.2f}x  {split}")
    print("ms/subnet: 1000 / the 1-device subnets/s. pair frac: each of two 1-device runs started together, as a "
          "fraction of the solo run (mean of the two); pair limit = 2 x pair frac, the hardware's limit for 2 stages.")
    failures = [f"  {s.name}: {e}" for s in chosen for e in summaries[s.name]["errors"]]
    if failures:
        print("failed runs:\n" + "\n".join(failures))
    print()


def telemetry(chosen: list[Space], quick: bool) -> dict[str, Result]:
    """One untimed 2-stage run per space with ``telemetry=True``; print each stage's busy fraction."""
    found = {}
    print("telemetry (separate 2-stage runs, not in the table):")
    for s in chosen:
        result = found[s.name] = launch(__file__, config(s, quick, 2, telemetry=True))
        if not ok(result):
            print(f"  {s.name}: failed: {result['error']}")
            continue
        busy = [result["metrics"].get(f"telemetry/busy_fraction_stage{k}", float("nan")) for k in range(2)]
        print(f"  {s.name}: busy {busy[0]:.0%} on stage 0, {busy[1]:.0%} on stage 1 "
              f"({result['subnets_per_s']:.2f} subnets/s with telemetry)")
    print()
    return found


def draw(chosen: list[Space], summaries: dict[str, dict[str, Any]]) -> Any:
    """Bars: the median 2-stage ratio per space, whiskers over the rounds, a marker at the pair limit."""
    def render(ax: Any) -> None:
        names = [s.name for s in chosen]
        medians = [summaries[n]["ratio_median"] for n in names]
        measured = [[x for x in summaries[n]["ratios"] if not math.isnan(x)] for n in names]
        low = [m - min(xs, default=m) for xs, m in zip(measured, medians)]
        high = [max(xs, default=m) - m for xs, m in zip(measured, medians)]
        ax.bar(range(len(names)), medians, yerr=[low, high], capsize=3, color="tab:blue",
               label="2 stages / 1 device (median, range over rounds)")
        ax.plot(range(len(names)), [2 * summaries[n]["pair_fraction"] for n in names], "k_", markersize=22, mew=2,
                label="pair limit (2 x pair fraction)")
        for i, m in enumerate(medians):
            ax.text(i, 0 if math.isnan(m) else m / 2, f"{m:.2f}x", ha="center", color="white", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("speed-up over 1 device (same round)")
        ax.legend(fontsize=7, loc="upper left")
    return render


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spaces", nargs="+", choices=list(SPACES), default=list(SPACES), help="which spaces")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer subnets, 1 round by default")
    parser.add_argument("--telemetry", action="store_true", help="also one untimed 2-stage run with telemetry")
    parser.add_argument("--plot", default="docs/zoo.png")
    parser.add_argument("--transport", choices=["auto", "shared_memory", "torch"], default="auto",
                        help="NASPipeStrategy(transport=...) of the 2-stage runs (default: the strategy's default)")
    add_common_args(parser)
    parser.set_defaults(repeats=None)  # rounds: 3, or 1 with --quick
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    rounds = args.repeats or (1 if args.quick else 3)
    TRANSPORT["kind"] = args.transport
    chosen = [space(name, args.quick) for name in args.spaces]
    shapes = {s.name: shape(s) for s in chosen}
    print(f"space zoo, default settings{' (--quick)' if args.quick else ''}; {machine()}")
    print("1 device: plain pl.Trainer(); 2 stages: NASPipeStrategy() on 2 stage processes (window 8, split timed on "
          "the first batch, chunks 1 unless noted); pair: two 1-device runs at once")
    for s in chosen:
        print(f"  {s.name}: {s.summary}; batch {s.batch}, {s.subnets} subnets ({s.warmup} warm-up)"
              + (f", chunks {s.chunks}" if s.chunks > 1 else ""))
    sys.stdout.flush()
    found = measure(chosen, rounds, args.quick)
    summaries = {name: summarize(r) for name, r in found.items()}
    print_report(chosen, shapes, summaries, rounds)
    extra = telemetry(chosen, args.quick) if args.telemetry else {}
    write_json(args.json, {"machine": machine(), "quick": args.quick, "rounds": found, "summary": summaries,
                           "telemetry": extra})
    plot(args.plot, draw(chosen, summaries), f"Space zoo, default NASPipeStrategy() on 2 stages vs 1 device "
         f"({rounds} round(s), {machine(short=True)})")


if __name__ == "__main__":
    main()
