"""How far to trust a latency lookup table: its predictions against end-to-end measured latency on every zoo space
(``zoo_spaces.py``: nb201's cells, spos, mobilenet, charlm, wide_mlp, wide_mlp_8ms) and on two spaces the table
was not written against (``latency_spaces.py``: an AutoFormer-style ViT with a shared elastic width and an
``ElasticDepth``, an OFA-style CNN with elastic depth, kernel and expansion and a user's own ``Elastic`` module), on
this machine.

For each space: build ``lnp.LatencyTable.measure`` on one batch of the space's own data (its batch size), then
``table.error(...)`` on ``--samples`` uniform architectures (each frozen subnet timed end to end), and print the
report's mean and worst absolute error and its bias. Run from the repository root on a quiet machine::

    PYTHONPATH=. python benchmarks/latency_error.py                  # 1 thread, 20 architectures per space
    PYTHONPATH=. python benchmarks/latency_error.py --spaces ofa autoformer --samples 5 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_naspipe as lnp  # noqa: E402
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
        start = time.perf_counter()
        table = lnp.LatencyTable.measure(supernet, example, args.repeats)
        built = time.perf_counter() - start
        report = table.error(supernet, example, samples=args.samples, seed=0, repeats=args.repeats)
        summary[name] = {"batch_size": table.batch_size, "architectures": len(report.rows),
                         "mean_abs_pct": report.mean_abs_pct, "worst_pct": report.worst_pct,
                         "bias_pct": report.bias_pct, "fastest_ms": table.fastest_ms(),
                         "slowest_ms": table.slowest_ms(), "table_seconds": built}
        print(f"{name:>12}: batch {table.batch_size}, predictions {table.fastest_ms():.2f}..{table.slowest_ms():.2f} "
              f"ms, table built in {built:.1f} s; {len(report.rows)} architectures: mean |error| "
              f"{report.mean_abs_pct:.1f}%, worst {report.worst_pct:.1f}%, bias {report.bias_pct:+.1f}%", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
