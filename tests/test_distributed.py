"""Collective helpers between stage processes (two real gloo processes)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_naspipe.transport.distributed import broadcast_object, gather_objects
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


def test_one_rank_gathers_without_a_process_group() -> None:
    assert gather_objects("alone", 1) == ["alone"]
