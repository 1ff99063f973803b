"""Point-to-point transport between two real processes (gloo), without Lightning."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_naspipe.boundary import map_tensors, tensors_in

from lightning_naspipe.schedule import build_schedule
from lightning_naspipe.transport import P2PTransport
from helpers import spawn_gloo_pair

pytestmark = pytest.mark.slow

VALUES = [
    torch.arange(6, dtype=torch.float32).view(2, 3),
    (torch.ones(2, 1, 4, dtype=torch.float64), torch.tensor([1, 2], dtype=torch.int64), torch.tensor(True)),
    (torch.zeros(0, 5, dtype=torch.bfloat16),),
    torch.full((3,), 7, dtype=torch.uint8),
    tuple(torch.full((1, 2, 1, 2), float(i)) for i in range(8)),  # a long header
]
# Values of one shape, as a stage boundary carries subnet after subnet: one message each.
STEADY = [torch.full((4, 3), float(i)) for i in range(5)]


def _worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60))
    # Two independent subnets on two stages: stage 1 may consume them in another order than
    # stage 0 sends them; the transport must buffer by the schedule's send order.
    schedule = build_schedule([[{"a"}, {"b"}], [{"c"}, {"d"}]], num_chunks=2)
    transport.begin_window(schedule)
    sends = schedule.sends(0, "forward")
    if rank == 0:
        for i, (subnet, chunk) in enumerate(sends):
            # Floating tensors require grad, as activations do: the flags travel with the values.
            value = map_tensors(lambda t: t.clone().requires_grad_(t.is_floating_point()), VALUES[i % len(VALUES)])
            transport.send_activation(subnet, chunk, value)
    else:
        got = {key: transport.recv_activation(*key) for key in reversed(sends)}
        results["ok"] = all(_same(got[key], VALUES[i % len(VALUES)]) for i, key in enumerate(sends))
        results["grad"] = all(t.requires_grad == t.is_floating_point() for v in got.values() for t in tensors_in(v))
    transport.end_window()
    before = transport.messages_sent
    for i, value in enumerate(STEADY):  # outside a window's schedule, as evaluation sends
        if rank == 0:
            transport.send_value(1, value)
        else:
            results[f"steady{i}"] = torch.equal(transport.recv_value(0), value)
    transport.end_window()
    results[f"steady_messages{rank}"] = transport.messages_sent - before
    results[f"shared{rank}"] = transport.share("from the last stage" if rank == 1 else None)
    dist.destroy_process_group()


def _same(a: object, b: object) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.detach(), b)
    return isinstance(a, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_messages_of_any_shape_and_dtype_arrive_by_schedule_order() -> None:
    results = spawn_gloo_pair(_worker)
    assert results["ok"] and results["grad"]
    assert all(results[f"steady{i}"] for i in range(len(STEADY)))
    # The first value of a new size is announced once; the others are a single message each.
    assert results["steady_messages0"] == len(STEADY) + 1
    assert results["shared0"] == results["shared1"] == "from the last stage"

