"""Point-to-point transport between two real processes (gloo), without Lightning."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_naspipe.schedule import build_schedule
from lightning_naspipe.transport import P2PTransport

pytestmark = pytest.mark.slow

VALUES = [
    torch.arange(6, dtype=torch.float32).view(2, 3),
    (torch.ones(2, 1, 4, dtype=torch.float64), torch.tensor([1, 2], dtype=torch.int64), torch.tensor(True)),
    (torch.zeros(0, 5, dtype=torch.bfloat16),),
    torch.full((3,), 7, dtype=torch.uint8),
    tuple(torch.full((1, 2, 1, 2), float(i)) for i in range(8)),  # a header longer than one message
]


def _worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60))
    # Two independent subnets on two stages: stage 1 may consume them in another order than
    # stage 0 sends them; the transport must buffer by the schedule's send order.
    schedule = build_schedule([[{"a"}, {"b"}], [{"c"}, {"d"}]], num_chunks=2)
    transport.begin_window(schedule)
    sends = schedule.sends(0, "forward")
    if rank == 0:
        for i, (subnet, chunk) in enumerate(sends):
            transport.send_activation(subnet, chunk, VALUES[i % len(VALUES)])
    else:
        got = {key: transport.recv_activation(*key) for key in reversed(sends)}
        results["ok"] = all(_same(got[key], VALUES[i % len(VALUES)]) for i, key in enumerate(sends))
        results["grad"] = got[sends[0]].requires_grad
    transport.end_window()
    results[f"shared{rank}"] = transport.share("from the last stage" if rank == 1 else None)
    dist.destroy_process_group()


def _same(a: object, b: object) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.detach(), b)
    return isinstance(a, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_messages_of_any_shape_and_dtype_arrive_by_schedule_order() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, results), nprocs=2, join=True)
        assert results["ok"] and results["grad"]
        assert results["shared0"] == results["shared1"] == "from the last stage"


def test_non_tensor_boundary_values_are_refused() -> None:
    from lightning_naspipe.transport import _flatten

    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        _flatten({"x": torch.ones(1)})
