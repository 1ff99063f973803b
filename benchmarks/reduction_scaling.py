"""The exact reduction and whole layouts on paper, up to 1,024 replicas and 8 stages (the planner's link model,
:mod:`lightning_naspipe.planning.links`; nothing runs).

Table 1: one update's reduction of ``--mb`` MB of gradients on ``D`` replicas, 8 devices per node: the streamed
exact chain (the runtime's), the same with no overlap of its two ways (a bound), the chain before pieces, and a
flat ring all-reduce, for each default link set. Table 2: predicted samples/s of the planner's ``wide_spec``
(8 choice blocks, 32 candidates, 1 ms of compute per block and micro-batch of 32 samples) on ``S x D``
devices, each replica training 4 micro-batches per subnet (weak scaling), with the streamed reduction and, for
comparison, as if each update's reduction were a ring all-reduce. Writes a two-panel plot. Run::

    python benchmarks/reduction_scaling.py                  # both tables and docs/reduction_scaling.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from lightning_naspipe.planning import links as L
from lightning_naspipe.planning import planner
from lightning_naspipe.planning.space_spec import wide_spec

REPLICAS = (2, 4, 8, 16, 64, 256, 1024)
STAGES = (1, 2, 4, 8)
PER_REPLICA_CHUNKS = 4


def reduction_table(mb: float) -> list[tuple[str, int, float, float, float, float]]:
    """``(links, D, streamed, no overlap, whole chain, ring)`` milliseconds."""
    rows = []
    for name, model in L.LINKS.items():
        for d in REPLICAS:
            nbytes = mb * 1e6
            rows.append((name, d, L.streamed_chain_ms(model, nbytes, d), L.sequential_chain_ms(model, nbytes, d),
                         L.whole_chain_ms(model, nbytes, d), L.ring_ms(model, nbytes, d)))
    return rows


def layout_throughput(model: L.LinkModel, stages: int, replicas: int, grad_mb: float, ring: bool) -> float:
    """Predicted samples/s of ``stages x replicas`` devices (weak scaling: each replica trains
    ``PER_REPLICA_CHUNKS`` micro-batches of 32 samples per subnet)."""
    chunks = PER_REPLICA_CHUNKS * replicas
    # One candidate's forward + backward per micro-batch: 1 ms, so a subnet's batch costs `chunks` of them.
    spec = wide_spec(32, 8, block_ms=chunks / 3, message_ms=0.01, step_overhead_ms=1.0)
    spec = replace(spec, blocks=[replace(b, candidates=[replace(c, grad_bytes=int(grad_mb * 1e6 / 8))
                                                       for c in b.candidates]) for b in spec.blocks])
    priced = planner.streamed_chain_ms
    if ring:  # the planner prices each update's reduction as a ring all-reduce (not exact) instead
        planner.streamed_chain_ms = L.ring_ms  # type: ignore[assignment]
    try:
        pred = planner.simulate(spec, stages, 16, chunks, replicas=replicas, links=model, subnets=32,
                                batch_size=32 * chunks)
    finally:
        planner.streamed_chain_ms = priced
    assert pred.samples_per_s is not None
    return pred.samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=32.0, help="gradient MB per update (table 1)")
    parser.add_argument("--grad-mb", type=float, default=64.0, help="a subnet's gradient MB, all stages (table 2)")
    parser.add_argument("--links", default="nvlink + ib400", choices=sorted(L.LINKS), help="table 2's links")
    parser.add_argument("--plot", default="docs/reduction_scaling.png")
    args = parser.parse_args()
    print(f"Table 1: one update's reduction of {args.mb:g} MB, ms (ratio to the ring); 8 devices per node")
    print(f"{'links':>16} {'D':>5} {'streamed':>15} {'no overlap':>15} {'whole chain':>17} {'ring':>8}")
    rows = reduction_table(args.mb)
    for name, d, streamed, sequential, whole, ring in rows:
        print(f"{name:>16} {d:>5} {streamed:>8.2f} ({streamed / ring:.2f}) {sequential:>8.2f} "
              f"({sequential / ring:.2f}) {whole:>9.1f} ({whole / ring:>5.1f}) {ring:>8.2f}")
    model = L.LINKS[args.links]
    print(f"\nTable 2: predicted samples/s, {args.links}, {args.grad_mb:g} MB of gradients per subnet, weak scaling "
          f"({PER_REPLICA_CHUNKS} micro-batches of 32 per replica); streamed exact (ring all-reduce instead)")
    print(f"{'S':>3} " + " ".join(f"{'D=' + str(d):>21}" for d in REPLICAS))
    throughput: dict[tuple[int, int, bool], float] = {}
    for stages in STAGES:
        for d in REPLICAS:
            for ring in (False, True):
                throughput[(stages, d, ring)] = layout_throughput(model, stages, d, args.grad_mb, ring)
        cells = [f"{throughput[(stages, d, False)]:>11.0f} ({throughput[(stages, d, True)]:>7.0f})" for d in REPLICAS]
        print(f"{stages:>3} " + " ".join(cells), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in L.LINKS:
        mine = [r for r in rows if r[0] == name]
        left.plot([r[1] for r in mine], [r[2] / r[5] for r in mine], marker="o", label=f"streamed, {name}")
        left.plot([r[1] for r in mine], [r[4] / r[5] for r in mine], ls="--", label=f"whole chain, {name}")
    left.axhline(2.0, color="gray", lw=0.8)
    left.set(xscale="log", yscale="log", xlabel="replicas D", ylabel="time / ring all-reduce",
             title=f"exact reduction of {args.mb:g} MB")
    left.legend(fontsize=7)
    for stages in STAGES:
        right.plot(REPLICAS, [throughput[(stages, d, False)] for d in REPLICAS], marker="o", label=f"S={stages}")
        right.plot(REPLICAS, [throughput[(stages, d, True)] for d in REPLICAS], ls=":", color="gray")
    right.set(xscale="log", yscale="log", xlabel="replicas D", ylabel="samples/s (dotted: ring all-reduce)",
              title=f"predicted throughput, {args.links}")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
