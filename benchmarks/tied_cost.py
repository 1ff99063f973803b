"""What a weight tied across stages costs: a GPT-style char-LM with its output head tied to the embedding or not.

The space sweep's char-LM (``space_sweep.CharLM`` with one embedding and one head, ``shared_io``) with the
head's weight the embedding table (``tied``) or a weight of its own, on the plain 1-device Trainer and on 2
stages (``NASPipeStrategy()``, every default: the embedding on stage 0, the head on stage 1). Tied on 2
stages, each subnet's first activation also carries the table from stage 0 to stage 1 and its input
gradients carry the head's contribution back (``lightning_naspipe.pipeline.exactness.ties``): no extra message, two
table-sized tensors more per subnet and chunk. Ratios are taken within a round (rotated order); the table
gives the medians of ``tied / untied`` throughput and the milliseconds a subnet gains. Run from the
repository root::

    python benchmarks/tied_cost.py --repeats 3
    python benchmarks/tied_cost.py --quick      # a smaller model, fewer subnets; a few minutes
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import lightning_naspipe as lnp
from common import add_common_args, fit_timed, launch, machine, ok, ran_as_worker, rate, rotated_rounds, write_json
from space_sweep import VOCAB, CharLM, text_loader

CONFIGS = ("1 device", "1 device, tied", "2 stages", "2 stages, tied")


class TiedCharLM(CharLM):
    """``CharLM`` with one embedding and one head; with ``tied``, the head's weight is the embedding table."""

    def __init__(self, layers: int, width: int, seq: int, tied: bool) -> None:
        super().__init__(32, layers, width, seq, shared_io=True)
        blocks = list(self.supernet.blocks)
        if tied:  # before the Supernet is built: its resources are keyed by the tensors blocks share
            blocks[-1][1].weight = blocks[0].table.weight
        self.supernet = lnp.Supernet(*blocks)


def sizes(quick: bool) -> tuple[int, int, int, int, int]:
    """layers, width, seq, batch, subnets."""
    return (4, 64, 64, 16, 48) if quick else (8, 128, 64, 16, 160)


def worker(cfg: dict[str, Any]) -> None:
    layers, width, seq, batch, subnets = sizes(cfg["quick"])
    strategy: Any = lnp.NASPipeStrategy() if cfg["stages"] else "auto"
    fit_timed(TiedCharLM(layers, width, seq, cfg["tied"]), text_loader(subnets * batch, seq, batch), cfg, strategy,
              max(cfg["stages"], 1))


def run(name: str, quick: bool) -> Any:
    layers, width, seq, batch, subnets = sizes(quick)
    cfg = {"stages": 2 if name.startswith("2") else 0, "tied": name.endswith("tied"), "quick": quick,
           "batch": batch, "warmup": 16 if quick else 32, "processes": 2 if name.startswith("2") else 1}
    return launch(__file__, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer subnets")
    add_common_args(parser)
    parser.set_defaults(repeats=2)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    layers, width, seq, batch, _ = sizes(args.quick)
    table = VOCAB * width * 4
    print(f"char-LM, {layers} layers of width {width}, seq {seq}, batch {batch}, the head tied to the embedding "
          f"or not; {machine()}\ntied on 2 stages: {table} bytes more in each subnet's first activation and in "
          "each of its gradient messages (one per chunk); no extra message", flush=True)
    found = rotated_rounds(CONFIGS, ["charlm"], args.repeats, lambda c, _: run(c, args.quick))["charlm"]
    good = [r for r in found if all(ok(r[c]) for c in CONFIGS)]
    if not good:
        print(f"failed: {[r[c].get('error') for r in found for c in CONFIGS if not ok(r[c])][:1]}")
        return

    def median(numerator: str, denominator: str) -> float:
        return statistics.median(rate(r[numerator]) / rate(r[denominator]) for r in good)

    def extra_ms(tied: str, untied: str) -> float:
        return statistics.median(1e3 / rate(r[tied]) - 1e3 / rate(r[untied]) for r in good)

    row = {"one_device_tied_over_untied": median("1 device, tied", "1 device"),
           "one_device_ms": extra_ms("1 device, tied", "1 device"),
           "stages_tied_over_untied": median("2 stages, tied", "2 stages"),
           "stages_ms": extra_ms("2 stages, tied", "2 stages"),
           "stages_over_one_device_tied": median("2 stages, tied", "1 device, tied"), "rounds": good}
    print(f"\n{'1 dev tied/untied':>18}{'+ms/subnet':>12}{'2 st tied/untied':>18}{'+ms/subnet':>12}"
          f"{'2 st/1 dev, tied':>18}")
    print(f"{row['one_device_tied_over_untied']:>17.2f}x{row['one_device_ms']:>12.2f}"
          f"{row['stages_tied_over_untied']:>17.2f}x{row['stages_ms']:>12.2f}{row['stages_over_one_device_tied']:>17.2f}x")
    if args.json:
        write_json(args.json, {"machine": machine(), "quick": args.quick, "table_bytes": table, "charlm": row})


if __name__ == "__main__":
    main()
