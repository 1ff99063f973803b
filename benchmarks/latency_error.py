"""How far to trust a latency lookup table: its predictions against end-to-end measured latency on every zoo space
(``zoo_spaces.py``: nb201's cells, spos, mobilenet, charlm, wide_mlp, wide_mlp_8ms) and on two spaces the table
was not written against (``latency_spaces.py``: an AutoFormer-style ViT with a shared elastic width and an
``ElasticDepth``, an OFA-style CNN with elastic depth, kernel and expansion and a user's own ``Elastic`` module), on
this machine.

For each space: build ``lnp.LatencyTable.measure`` on one batch of the space's own data (its batch size), then
``table.error(...)`` on ``--samples`` uniform architectures (each frozen subnet timed end to end), and print the
report's mean and worst absolute error and its bias, as a user sees them. Then, centred in time: the same
architectures timed end to end once more and a second table built after that, the two tables' mean prediction
against the two passes' mean (a machine whose speed drifts between the table and the passes, as a shared VM's does
over minutes, biases the first comparison; a steady drift cancels in this one), and the noise floor: how far the
two passes, and the two tables, are apart. Run from the repository root on a quiet machine::

    PYTHONPATH=. python benchmarks/latency_error.py                  # 1 thread, 20 architectures per space
    PYTHONPATH=. python benchmarks/latency_error.py --spaces ofa autoformer --samples 5 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_naspipe as lnp  # noqa: E402
from lightning_naspipe.searching.latency_report import LatencyReport  # noqa: E402
from lightning_naspipe.space.supernet import supernet_of  # noqa: E402
from latency_spaces import SPACES as UNSEEN  # noqa: E402
from latency_spaces import latency_space  # noqa: E402
from zoo_spaces import SPACES as ZOO  # noqa: E402
from zoo_spaces import space  # noqa: E402

ALL_SPACES = (*ZOO, *UNSEEN)


def supernet_and_input(name: str) -> tuple[lnp.Supernet, Any]:
    """Space ``name``'s supernet (eval mode) and what its first block receives for one batch of its data."""
    torch.manual_seed(0)
    if name in UNSEEN:
        return latency_space(name)
    described = space(name)
    model = described.model()
    return supernet_of(model).eval(), model.pipeline_input(next(iter(described.data(1))))


def measured_error(supernet: lnp.Supernet, example: Any, samples: int, repeats: int) -> dict[str, Any]:
    """A table's error as a user sees it (the table, then ``table.error``), and centred in time: a second end-to-end
    pass and a second table after it, the mean of the two tables' predictions against the mean of the two passes.
    On a machine whose speed drifts over minutes (a shared VM), the first compares timings taken minutes apart;
    the second cancels a steady drift. The noise floor: how far the two passes (and the two tables) are apart."""
    start = time.perf_counter()
    before = lnp.LatencyTable.measure(supernet, example, repeats)
    built = time.perf_counter() - start
    first = before.error(supernet, example, samples=samples, seed=0, repeats=repeats)
    archs = [a for a, _, _ in first.rows]
    second = before.error(supernet, example, architectures=archs, repeats=repeats)
    after = lnp.LatencyTable.measure(supernet, example, repeats)

    def report(predicted: Sequence[float], measured: Sequence[float]) -> LatencyReport:
        return LatencyReport(tuple(zip(archs, predicted, measured)), first.device, first.batch_size)

    passes = [[ms for _, _, ms in r.rows] for r in (first, second)]
    tables = [[t.predict(a, supernet) for a in archs] for t in (before, after)]
    centred = report([sum(p) / 2 for p in zip(*tables)], [sum(m) / 2 for m in zip(*passes)])
    noise, apart = report(passes[1], passes[0]), report(tables[1], tables[0])
    return {"batch_size": before.batch_size, "architectures": len(archs), "fastest_ms": before.fastest_ms(),
            "slowest_ms": before.slowest_ms(), "table_seconds": built, "mean_abs_pct": first.mean_abs_pct,
            "worst_pct": first.worst_pct, "bias_pct": first.bias_pct, "centred_mean_abs_pct": centred.mean_abs_pct,
            "centred_worst_pct": centred.worst_pct, "centred_bias_pct": centred.bias_pct,
            "noise_mean_abs_pct": noise.mean_abs_pct, "noise_worst_pct": noise.worst_pct,
            "tables_mean_abs_pct": apart.mean_abs_pct, "tables_worst_pct": apart.worst_pct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spaces", nargs="+", default=list(ALL_SPACES), choices=ALL_SPACES,
                        help="default: all of them")
    parser.add_argument("--samples", type=int, default=20, help="architectures per space (default 20)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"{args.threads} thread(s), repeats {args.repeats}, {args.samples} architectures per space")
    summary = {}
    for name in args.spaces:
        supernet, example = supernet_and_input(name)
        summary[name] = measured_error(supernet, example, args.samples, args.repeats)
        r = summary[name]
        print(f"{name:>12}: batch {r['batch_size']}, predictions {r['fastest_ms']:.2f}..{r['slowest_ms']:.2f} ms, "
              f"table built in {r['table_seconds']:.1f} s; {r['architectures']} architectures: mean |error| "
              f"{r['mean_abs_pct']:.1f}%, worst {r['worst_pct']:.1f}%, bias {r['bias_pct']:+.1f}%; centred in time: "
              f"{r['centred_mean_abs_pct']:.1f}% / {r['centred_worst_pct']:.1f}% (bias {r['centred_bias_pct']:+.1f}%); "
              f"noise: two end-to-end passes {r['noise_mean_abs_pct']:.1f}% / {r['noise_worst_pct']:.1f}% apart, "
              f"two tables {r['tables_mean_abs_pct']:.1f}% / {r['tables_worst_pct']:.1f}%", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
