"""Collective helpers between stage processes (two real gloo processes)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torch import nn

from lightning_naspipe.transport.distributed import (broadcast_object, broadcast_tensors_, gather_objects,
                                                     gather_optimizer_state, sync_stage_weights)
from helpers import spawn_gloo_pair

pytestmark = pytest.mark.slow


def _worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results[f"gathered{rank}"] = gather_objects({"rank": rank, "stat": 0.5 * rank}, 2)
    results[f"broadcast{rank}"] = broadcast_object(("from rank 1", [rank]), 1, torch.device("cpu"))
    dist.destroy_process_group()


def test_every_rank_gets_every_ranks_object_in_rank_order() -> None:
    results = spawn_gloo_pair(_worker)
    expected = [{"rank": 0, "stat": 0.0}, {"rank": 1, "stat": 0.5}]
    assert results["gathered0"] == results["gathered1"] == expected
    assert results["broadcast0"] == results["broadcast1"] == ("from rank 1", [1])


def _blocks(rank: int) -> list[nn.Module]:
    torch.manual_seed(rank)  # different values on each rank
    return [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), nn.Linear(4, 4), nn.Linear(4, 2)]


def _sync_worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    blocks, owners = _blocks(rank), [_blocks(0), _blocks(1)]
    # Stage 0 owns blocks 0-1, stage 1 block 2; only the tensors named in `only` may differ.
    only = {id(blocks[0][0].weight), id(blocks[0][1].running_mean), id(blocks[0][1].num_batches_tracked),
            id(blocks[2].bias)}
    sent = sync_stage_weights(blocks, [range(0, 2), range(2, 3)], [0, 1], torch.device("cpu"), only)
    expected = [owners[0][0], owners[0][1], owners[1][2]]
    results[f"sent{rank}"] = sent
    results[f"exact{rank}"] = [
        torch.equal(mine, (theirs if id(mine) in only else ours))
        for block, owner, own in zip(blocks, expected, _blocks(rank))
        for mine, theirs, ours in zip((*block.parameters(), *block.buffers()), (*owner.parameters(), *owner.buffers()),
                                      (*own.parameters(), *own.buffers()))]
    everything = sync_stage_weights(blocks, [range(0, 2), range(2, 3)], [0, 1], torch.device("cpu"))
    results[f"all{rank}"] = everything
    # Every dtype (float weights, int64 counters) packed, in buckets smaller than one tensor, from rank 1.
    broadcast_tensors_([t for b in blocks for t in (*b.parameters(), *b.buffers())], 1, torch.device("cpu"),
                       bucket_bytes=16)
    results[f"state{rank}"] = [t.tolist() for b in blocks for t in (*b.parameters(), *b.buffers())]
    dist.destroy_process_group()


def test_stage_weights_sync_sends_exactly_the_changed_tensors_from_their_owners() -> None:
    results = spawn_gloo_pair(_sync_worker)
    assert results["sent0"] == results["sent1"] == 4
    assert all(results["exact0"]) and all(results["exact1"])
    assert results["all0"] == results["all1"] == 11  # 2 + 5 (BatchNorm: weight, bias, 3 buffers) + 2 + 2
    synced = [*_blocks(0)[:2], _blocks(1)[2]]
    expected = [t.tolist() for b in synced for t in (*b.parameters(), *b.buffers())]
    assert results["state0"] == results["state1"] == expected


def _stepped(rank: int) -> tuple[list[nn.Module], torch.optim.Optimizer]:
    """Three blocks under Adam; rank 0 steps block 0, rank 1 blocks 1 and 2 (each its own state only)."""
    blocks = _blocks(0)
    optimizer = torch.optim.Adam([p for b in blocks for p in b.parameters()], lr=0.1)
    mine = blocks[:1] if rank == 0 else blocks[1:]
    for _ in range(2 + rank):  # different step counts per rank
        for b in mine:
            for p in b.parameters():
                p.grad = torch.full_like(p, 0.5 + rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return mine, optimizer


def _optimizer_worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    mine, optimizer = _stepped(rank)
    state = gather_optimizer_state(optimizer, {id(p) for b in mine for p in b.parameters()}, torch.device("cpu"))
    results[f"state{rank}"] = {i: {k: v.tolist() for k, v in s.items()} for i, s in state["state"].items()}
    dist.destroy_process_group()


def test_optimizer_state_gathers_each_parameters_state_from_its_owner() -> None:
    results = spawn_gloo_pair(_optimizer_worker)
    expected = {}
    for rank in (0, 1):  # what each rank stepped, in the standard index layout
        _, optimizer = _stepped(rank)
        expected.update({i: {k: v.tolist() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()})
    assert sorted(expected) == list(range(8)) and results["state0"] == results["state1"] == expected


def test_one_rank_gathers_without_a_process_group() -> None:
    assert gather_objects("alone", 1) == ["alone"]
