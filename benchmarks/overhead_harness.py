"""Run-dependent overheads for the planner, measured on this machine (benchmarks only).

:func:`lightning_overheads` times Lightning's loop beyond the engine's, :func:`pipeline_overheads`
the transport, the shared-core slowdown and the per-window sync on two gloo processes. Pass their
results to ``profile_supernet(..., **overheads)``; ``planner_accuracy.py`` does.
"""

from __future__ import annotations

import itertools
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.space.boundary import map_tensors, tensors_in
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.planning.profile import _default_optimizer, _NullModule
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.space.supernet import Supernet

__all__ = ["lightning_overheads", "pipeline_overheads"]


def lightning_overheads(batch_size: int = 1, features: int = 1, steps: int = 512) -> dict[str, float]:
    """Lightning's own time beyond the engine's, per window and per subnet (~1-2 s).

    A module whose supernet is one ``Linear(features, 1)`` is trained on one device with windows of
    1 and of 8, fed ``(input, target)`` batches from a ``TensorDataset``; the engine's own time for
    it is subtracted.

    Args:
        batch_size: samples per batch, as in training (collating a batch is part of the cost).
        features: features per sample.
        steps: subnets per run.

    Returns:
        ``{"step_overhead_ms": ..., "subnet_overhead_ms": ...}``, to pass to :func:`profile_supernet`.
    """
    import pytorch_lightning as pl

    from lightning_naspipe.integration.mixin import NASPipeMixin
    from lightning_naspipe.integration.strategy import NASPipeStrategy

    class Tiny(NASPipeMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.supernet = Supernet(nn.Linear(features, 1))

        def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
            return output.sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _default_optimizer(list(self.parameters()))

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.times.append(time.perf_counter())

    per_subnet = {}
    samples = torch.zeros(steps * batch_size, features)
    for window in (1, 8):
        clock = Clock()
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(samples, samples), batch_size=batch_size)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=NASPipeStrategy(window=window), max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[clock])
        with torch.random.fork_rng(devices=[]):
            trainer.fit(Tiny(), data)
        # The mean after warm-up windows, not the median: throughput pays the garbage collector's
        # pauses and the occasional slow step too.
        timed = clock.times[4:]
        per_subnet[window] = 1000 * (timed[-1] - timed[0]) / (len(timed) - 1) / window
    module, engine = _NullModule(Supernet(nn.Linear(features, 1))), Engine([range(1)])
    start = time.perf_counter()
    for first in range(0, steps, 8):
        engine.train_window(module, [torch.zeros(batch_size, features)] * 8, first)
    engine_ms = 1000 * (time.perf_counter() - start) / steps
    per_window = max(0.0, (per_subnet[1] - per_subnet[8]) * 8 / 7)
    return {"step_overhead_ms": per_window, "subnet_overhead_ms": max(0.0, per_subnet[8] - per_window / 8 - engine_ms)}


def pipeline_overheads(supernet: Supernet, sample_input: Any, rounds: int = 30) -> dict[str, float]:
    """Costs of two stage processes on this machine, over gloo and the real transport (~15 s).

    Two processes (``torch.multiprocessing.spawn``; call it under ``if __name__ == "__main__":``),
    each on its half of the blocks, train sampled paths one at a time, forward then backward as the
    profile times them, then both at once in a stage's order (a subnet's forward before the previous
    one's backward) while each sends and receives a message per path (``parallel_slowdown``: the
    compute's slowdown in a pipeline stage: caches that the next subnet's forward cooled, cores shared
    with each other and with the transport); receive the activation a stage
    boundary carries while its sender computes (``message_ms``: the wait beyond a message's own
    time, ``message_cpu_ms``); and share a window's losses and preemption flags at its end
    (``sync_ms``).

    Args:
        supernet: the search space (each process trains its own copy).
        sample_input: what the first block receives for one subnet batch.
        rounds: repetitions of each measurement; medians are kept.

    Returns:
        Those four :class:`SpaceSpec` fields, to pass to :func:`profile_supernet`.
    """
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        args = (port, supernet, sample_input, rounds, out)
        mp.spawn(_pipeline_worker, args, nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
        first, second = (torch.load(os.path.join(out, f"{rank}.pt")) for rank in (0, 1))
    return {key: (first[key] + second[key]) / 2 for key in first}


def _pipeline_worker(rank: int, port: int, net: Supernet, x: Any, rounds: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_naspipe.transport.p2p import P2PTransport

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    link = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(minutes=2))
    first = dict.fromkeys(net.labels, 0)  # the candidate-0 path, nested choices (cells) included
    with torch.no_grad():
        message = x
        for i in range(len(net) // 2):
            message = net.run_block(i, message, first)
    blocks = range(len(net) // 2) if rank == 0 else range(len(net) // 2, len(net))
    paths = iter(uniform_architecture(net.labels, rank, i) for i in itertools.count())

    def forward() -> Tensor:
        y = x if rank == 0 else map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), message)
        arch = next(paths)
        for i in blocks:
            y = net.run_block(i, y, arch)
        return sum((t.float().sum() for t in tensors_in(y) if t.requires_grad), torch.zeros((), requires_grad=True))

    def train(times: int, exchange: bool = False) -> list[float]:
        took, pending = [], forward() if exchange else None
        for _ in range(times):
            if exchange:  # as a stage does: a message out and one in per subnet
                link.send_value(1 - rank, message)
            start = time.perf_counter()
            if pending is None:
                forward().backward()
            else:
                ahead = forward()
                pending.backward()
                pending = ahead
            took.append(time.perf_counter() - start)
            if exchange:
                link.recv_value(1 - rank)
                link.end_window()
        return took

    train(2)
    alone: list[float] = []
    together: list[float] = []
    for _ in range(3):  # each stage alone while the other waits, then both at once, messaging; three times
        for turn in (0, 1):
            dist.barrier()
            alone += train(rounds // 3 + 1) if rank == turn else []
        dist.barrier()
        together += train(rounds // 3 + 1, exchange=True)
    dist.barrier()
    send, receive, waited, sync = [], [], [], []
    for _ in range(rounds + 1):
        # A message moves once the receiver asks for it (a rendezvous); in training the sender is then
        # computing, and its transport thread must get the core: the receiver waits that long.
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            link.send_value(1, message)
            send.append(time.perf_counter() - t0)
            train(1)
        else:
            time.sleep(0.001)
            t0 = time.perf_counter()
            link.recv_value(0)
            waited.append(time.perf_counter() - t0)
        link.end_window()
        dist.barrier()  # the stage's own time to take a message from an idle sender
        if rank == 1:
            link.send_value(0, message)
        else:
            time.sleep(0.005)
            t0 = time.perf_counter()
            link.recv_value(1)
            receive.append(time.perf_counter() - t0)
        link.end_window()
        dist.barrier()
        t0 = time.perf_counter()
        link.share_window_end([torch.zeros(())] * 16, (0, 0))  # the losses and the preemption flags
        sync.append(time.perf_counter() - t0)
    medians = torch.tensor([statistics.median(send + receive) if rank == 0 else 0.0,
                            statistics.mean(waited[1:]) if rank == 1 else 0.0])  # the mean: waits come in bursts
    dist.all_reduce(medians)
    cpu, latency = medians[0].item(), max(0.0, medians[1].item() - medians[0].item())
    slowdown = max(1.0, statistics.median(together) / statistics.median(alone))
    torch.save({"message_cpu_ms": 1000 * cpu, "message_ms": 1000 * latency, "parallel_slowdown": slowdown,
                "sync_ms": 1000 * statistics.median(sync)}, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()
