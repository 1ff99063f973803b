"""Point-to-point transport between two real processes (gloo), without Lightning."""

from __future__ import annotations

import functools
import glob
import os
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_naspipe.space.boundary import map_tensors, tensors_in

from lightning_naspipe.schedule.actions import Action, Schedule
from lightning_naspipe.schedule.schedules import build_schedule
from lightning_naspipe.transport.shm_links import SharedMemoryLinks
from lightning_naspipe.transport import shm_links, torch_links
from lightning_naspipe.transport.p2p import P2PTransport, StageFailure
from helpers import spawn_gloo_pair

pytestmark = pytest.mark.slow

VALUES = [
    torch.arange(6, dtype=torch.float32).view(2, 3),
    (torch.ones(2, 1, 4, dtype=torch.float64), torch.tensor([1, 2], dtype=torch.int64), torch.tensor(True)),
    (torch.zeros(0, 5, dtype=torch.bfloat16),),
    torch.full((3,), 7, dtype=torch.uint8),
    tuple(torch.full((1, 2, 1, 2), float(i)) for i in range(8)),  # a long header
]
# A window's losses as the last stage computed them: bit patterns a float32 round trip would change.
LOSSES = [torch.tensor(1 / 3, dtype=torch.bfloat16), torch.tensor(1e-40, dtype=torch.bfloat16),
          torch.tensor(float("inf"), dtype=torch.bfloat16)]
# Each window end's flags on stage 0 and stage 1, and what both agree on: stage 0's travel up one window
# behind (stage 1 ends its windows first, and must not wait for stage 0's last backward).
WINDOW_END_FLAGS = [((1, 0), (0, 0)), ((0, 1), (0, 0)), ((0, 0), (1, 0))]
AGREED = [[0, 0], [1, 0], [1, 1]]
# Values of one shape, as a stage boundary carries subnet after subnet: one message each.
STEADY = [torch.full((4, 3), float(i)) for i in range(5)]


def _worker(rank: int, init_method: str, results: dict, links: Any) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60), links=links)
    results[f"links{rank}"] = type(transport.links).__name__
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
    gradients = schedule.sends(1, "backward")
    if rank == 1:  # gradients back, received in another order than sent, too
        for i, (subnet, chunk) in enumerate(gradients):
            transport.send_gradient(subnet, chunk, STEADY[i])
    else:
        back = {key: transport.recv_gradient(*key) for key in reversed(gradients)}
        results["gradients"] = all(torch.equal(back[key], STEADY[i]) for i, key in enumerate(gradients))
    transport.end_window()
    # A forward run ahead: stage 0 sends subnet 100's activation, stage 1 uses it only in the next window.
    transport.begin_window(Schedule(((Action("F", 0),), ()), {}, {}), first_index=100)
    if rank == 0:
        transport.send_activation(100, 0, LOSSES[0])
    transport.end_window()  # stage 1 takes the activation off the link: evaluation may use it next
    transport.begin_window(Schedule(((), (Action("F", 0),)), {}, {}), first_index=100)
    if rank == 1:
        results["ahead"] = torch.equal(transport.recv_activation(100, 0), LOSSES[0])
        transport._buffer["forward"][(200, 0)] = STEADY[2]
        transport.drop_from(200)  # a lookahead dropped: its messages too
        results["dropped"] = not transport._buffer["forward"]
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
    for k, flags in enumerate(WINDOW_END_FLAGS):  # the last stage's losses come back with the agreed flags
        losses = [loss if rank == 1 else None for loss in LOSSES]
        records = [(3 + k, "train_acc", torch.tensor(0.5 * k), (), {"on_epoch": True})] if rank == 1 and k else []
        results[f"window_end{rank}_{k}"] = transport.share_window_end(losses, flags[rank], records)
        if k == 1:  # an evaluation between windows: the flags stage 0 sent still reach stage 1's next window end
            if rank == 0:
                transport.send_value(1, STEADY[3])
            else:
                results["between"] = torch.equal(transport.recv_value(0), STEADY[3])
    transport.close()
    dist.destroy_process_group()


def _same(a: object, b: object) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.detach(), b)
    return isinstance(a, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("links", ["auto", "torch"])
def test_messages_of_any_shape_and_dtype_arrive_by_schedule_order(links: str) -> None:
    results = spawn_gloo_pair(functools.partial(_worker, links=links))
    # Two processes of one host: shared memory unless asked otherwise.
    assert results["links0"] == results["links1"] == ("SharedMemoryLinks" if links == "auto" else "TorchLinks")
    assert results["ok"] and results["grad"] and results["gradients"]
    assert results["ahead"] and results["dropped"]
    assert all(results[f"steady{i}"] for i in range(len(STEADY)))
    assert results["between"]
    for k, expected in enumerate(AGREED):
        for rank in (0, 1):
            losses, agreed, records = results[f"window_end{rank}_{k}"]
            assert agreed == expected, f"window end {k}, stage {rank}"
            # What compute_loss logged on the last stage (none in the first window) reaches every stage.
            assert [(i, name, float(value), args, kwargs) for i, name, value, args, kwargs in records] == (
                [(3 + k, "train_acc", 0.5 * k, (), {"on_epoch": True})] if k else [])
            assert [loss.dtype for loss in losses] == [torch.bfloat16] * len(LOSSES)
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(losses, LOSSES))
    # torch links announce the first value of a new size once; the others are a single message each.
    assert results["steady_messages0"] == len(STEADY) + (links == "torch")
    assert results["shared0"] == results["shared1"] == "from the last stage"


def _flood_worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60), links="shared_memory")
    links = transport.links
    assert isinstance(links, SharedMemoryLinks)
    dist.barrier()  # stage 0 removes the FIFOs' folder once every stage is past connect
    results[f"files_after_connect{rank}"] = glob.glob(links.folder + "*")
    # 3 MiB values and small ones, all sent before the receiver reads any: the 4 MiB first ring
    # cannot hold them, so the sender must move to larger rings without waiting.
    values = [torch.full((3 << 18,), float(i)) if i % 3 else torch.full((5,), float(i)) for i in range(12)]
    if rank == 0:
        for value in values:
            transport.send_value(1, value)
    dist.barrier()
    if rank == 1:
        results["flood"] = all(torch.equal(transport.recv_value(0), value) for value in values)
        for value in values:  # and back, reusing the space the receiver acknowledged
            transport.send_value(0, value)
    else:
        results["back"] = all(torch.equal(transport.recv_value(1), value) for value in values)
    dist.barrier()
    results[f"files_after_exchange{rank}"] = glob.glob(links.folder + "*")  # every ring unlinked once mapped
    if rank == 0:  # one more, never read
        transport.send_value(1, torch.ones(3))
    dist.barrier()
    transport.close()
    results[f"files_after_close{rank}"] = glob.glob(links.folder + "*")
    dist.destroy_process_group()


def test_shared_memory_links_never_block_the_sender_and_leave_no_files() -> None:
    results = spawn_gloo_pair(_flood_worker)
    assert results["flood"] and results["back"]
    for moment in ("connect", "exchange", "close"):  # FIFOs unlinked once open, rings once mapped or closed
        assert results[f"files_after_{moment}0"] == results[f"files_after_{moment}1"] == []


def _dying_sender_worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=300), links="shared_memory")
    if rank == 0:
        os._exit(0)  # a stage process killed without a word
    try:
        transport.recv_value(0)
    except StageFailure as error:
        results["error"] = str(error)
    os._exit(0)  # the process group's peer is gone: skip its teardown


def test_a_receiver_learns_at_once_that_its_sender_died() -> None:
    results = spawn_gloo_pair(_dying_sender_worker)
    # The closed FIFO ends the wait (EOFError), not the 300 s timeout (TimeoutError).
    assert "Pipeline stage 0 (rank 0) failed or exited: it stopped sending (its process closed the link)" in \
        results["error"], results["error"]



class _CountedPoll:
    """Stands in for a link's ``select.poll`` object: counts the sleeps."""

    def __init__(self, poll: Any) -> None:
        self.poll_object, self.sleeps = poll, 0

    def poll(self, timeout_ms: float) -> Any:
        self.sleeps += 1
        return self.poll_object.poll(timeout_ms)


SPINS = {30.0: False, 0.01: True, 0.0: True}  # spin_s: whether a receive 0.3 s early sleeps


def _spinning_worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    for spin_s in SPINS:  # one process pair for all (starting one costs seconds)
        transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60), links="shared_memory",
                                 spin_s=spin_s)
        links = transport.links
        assert isinstance(links, SharedMemoryLinks)
        dist.barrier()
        if rank == 0:
            time.sleep(0.3)  # the receiver is waiting by now
            transport.send_value(1, torch.arange(4.0))
        else:
            counted = links._polls[0] = _CountedPoll(links._polls[0])
            results[spin_s] = (transport.recv_value(0), counted.sleeps)
        dist.barrier()
        transport.close()
    dist.destroy_process_group()


def test_a_receive_polls_without_sleeping_for_spin_s_then_sleeps() -> None:
    results = spawn_gloo_pair(_spinning_worker)
    for spin_s, slept in SPINS.items():
        value, sleeps = results[spin_s]
        assert torch.equal(value, torch.arange(4.0))
        assert (sleeps > 0) == slept, spin_s


def _idle_worker(rank: int, init_method: str, results: dict, links: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=60), links=links)
    dist.barrier()
    if rank == 0:
        transport.send_value(1, torch.arange(3.0))  # there before stage 1 asks
        time.sleep(0.5)  # stage 1 waits for the next one by now
        transport.send_value(1, torch.arange(4.0))
    else:
        asked: list[int] = []
        time.sleep(0.2)
        transport.idle = lambda: bool(asked.append(1))  # nothing to do
        results["first"] = transport.recv_value(0)
        results["asked"] = len(asked)
        calls: list[float] = []

        # The links' clock: real time plus 30 ms per unit of idle work, which takes no real time. Waiting is then
        # the real time the receive blocked, and the receive's span exceeds it by exactly the work.
        work_s = [0.0]
        clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + work_s[0], monotonic=time.monotonic)
        shm_links.time = torch_links.time = clock  # type: ignore[assignment]  # this process only

        def work() -> bool:  # five units of 30 ms, then nothing left
            calls.append(clock.perf_counter())
            if len(calls) > 5:
                return False
            work_s[0] += 0.03
            return True

        transport.idle = work
        start, waited = clock.perf_counter(), transport.wait_s
        results["second"] = transport.recv_value(0)
        results["elapsed"], results["waited"] = clock.perf_counter() - start, transport.wait_s - waited
        results["calls"] = len(calls)
    dist.barrier()
    transport.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("links", ["shared_memory", "torch"])
def test_a_waiting_receive_does_the_idle_work_and_does_not_count_it_as_waiting(links: str) -> None:
    results = spawn_gloo_pair(functools.partial(_idle_worker, links=links))
    assert torch.equal(results["first"], torch.arange(3.0)) and torch.equal(results["second"], torch.arange(4.0))
    if links == "shared_memory":
        assert results["asked"] == 0  # the message was there: taken without asking for work
    assert results["calls"] == 6  # five units, then "nothing left", then the wait
    # The blocked time counts; the work's 0.15 s does not. The tolerance is for the real cost of six calls of work()
    # (a preempted one included); counting the work, or taking it off twice, is 0.15 s off.
    assert results["waited"] > 0, results
    assert results["elapsed"] - results["waited"] == pytest.approx(0.15, abs=0.05), results
