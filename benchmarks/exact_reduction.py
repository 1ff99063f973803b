"""What the replicas' exact reduction costs against ``torch.distributed.all_reduce`` of the same bytes.

``D`` processes (torch.multiprocessing, gloo, one intra-op thread each) each hold the gradients of one update
(4 float32 tensors of ``size`` MB in all, one addend per replica) and, in the same run, time:

* ``all_reduce``: ``dist.all_reduce`` of one flat tensor of those bytes (gloo's ring; not exact: its order
  depends on ``D``);
* ``chain``: the exact chain as it was before pieces: replica 0's whole packed gradient down the chain, each
  replica adding its addend, the last one's sum relayed back down (``2 (D - 1)`` whole-gradient hops);
* ``streamed``: :func:`~lightning_naspipe.pipeline.exactness.streamed.streamed_sum`, the runtime's reduction.

Both chains use the replicas' own links (:class:`~lightning_naspipe.transport.replica_links.ReplicaLinks`:
shared memory on one host, or ``--links torch`` for gloo's point-to-point calls). Each is timed ``--repeats``
times after a warm-up; the table gives the fastest (the host may be shared) and the ratio to ``all_reduce``.
Run from the repository root::

    python benchmarks/exact_reduction.py                      # D = 2 and 4; 1, 8 and 32 MB
    python benchmarks/exact_reduction.py --replicas 2 --sizes 1 --repeats 3   # a quick check
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_naspipe.pipeline.exactness.streamed import stream_pieces, streamed_sum
from lightning_naspipe.transport.replica_links import ReplicaLinks

METHODS = ("all_reduce", "chain", "streamed")


def _whole_chain(links: ReplicaLinks, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The unstreamed exact chain: the packed gradient down, one addend per replica, the sum relayed back."""
    mine = torch.cat([g.reshape(-1) for g in grads])
    if links.replica > 0:
        mine = links.recv_previous().add_(mine)  # prefix + this replica's addend, as the old reduce did
    last = links.replica == links.replicas - 1
    if not last:
        links.send_next(mine)
    total = links.from_last(mine if last else None)
    return list(total.split([g.numel() for g in grads]))


def _worker(rank: int, replicas: int, port: int, sizes: list[float], repeats: int, kind: str,
            out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=replicas, timeout=timedelta(seconds=120))
    links = ReplicaLinks(rank, list(range(replicas)), [f"replica {r}" for r in range(replicas)], None,
                         torch.device("cpu"), timedelta(seconds=120), links=kind)
    results = {}
    for size in sizes:
        numel = int(size * 2**20) // 4
        generator = torch.Generator().manual_seed(rank)
        grads = [torch.randn(n, generator=generator) for n in (numel // 2, numel // 4, numel // 8, numel - numel // 2
                                                               - numel // 4 - numel // 8)]
        flat = torch.cat(grads)
        runs: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(flat.clone()),
            "chain": lambda: _whole_chain(links, grads),
            "streamed": lambda: streamed_sum(links, [[g] for g in grads], grads),
        }
        assert all(torch.equal(a, b) for a, b in zip(_whole_chain(links, grads), streamed_sum(
            links, [[g] for g in grads], grads))), "the streamed sum differs from the chain's"
        times: dict[str, list[float]] = {method: [] for method in METHODS}
        for _ in range(repeats + 1):  # the first round is a warm-up; methods alternate, so load hits each alike
            for method in METHODS:
                dist.barrier()
                start = time.perf_counter()
                runs[method]()
                dist.barrier()  # the slowest replica's end: every replica has the sum
                times[method].append(time.perf_counter() - start)
        best = {method: min(t[1:]) * 1000 for method, t in times.items()}
        results[size] = best
    links.close()
    dist.barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def measure(replicas: int, sizes: list[float], repeats: int, kind: str) -> dict[float, dict[str, float]]:
    """Milliseconds per reduction, the fastest of ``repeats``, per size (MB) and method."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(r, replicas, port, sizes, repeats, kind, out))
                 for r in range(replicas)]
    for p in processes:
        p.start()
    results: dict[float, dict[str, float]] = out.get(timeout=1800)
    for p in processes:
        p.join(timeout=60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 32], help="MB of gradients per update")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--links", default="shared_memory", choices=["shared_memory", "torch"])
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, 1 thread per process, "
          f"{args.links} links, fastest of {args.repeats}")
    print(f"{'D':>3} {'MB':>5} {'pieces':>6} {'all_reduce ms':>13} {'chain ms':>9} {'streamed ms':>11} "
          f"{'chain/AR':>8} {'streamed/AR':>11}")
    for replicas in args.replicas:
        for size, ms in measure(replicas, args.sizes, args.repeats, args.links).items():
            pieces = stream_pieces(int(size * 2**20), replicas)
            print(f"{replicas:>3} {size:>5g} {pieces:>6} {ms['all_reduce']:>13.2f} {ms['chain']:>9.2f} "
                  f"{ms['streamed']:>11.2f} {ms['chain'] / ms['all_reduce']:>8.2f} "
                  f"{ms['streamed'] / ms['all_reduce']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
