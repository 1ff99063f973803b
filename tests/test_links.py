"""The planner's link model (lightning_naspipe/planning/links.py): the streamed exact reduction against a ring
all-reduce, and where node boundaries fall."""

from __future__ import annotations

import pytest

from lightning_naspipe.planning.links import (LINKS, Link, LinkModel, ring_ms, sequential_chain_ms,
                                              streamed_chain_ms, whole_chain_ms)


def test_hops_cross_nodes_where_ranks_do() -> None:
    model = LinkModel(Link(100.0, 1.0), Link(10.0, 5.0), per_node=4)
    assert model.hops(6, first_rank=0) == [model.intra] * 3 + [model.inter, model.intra]
    assert model.hops(3, first_rank=2) == [model.intra, model.inter]


def test_one_piece_is_the_whole_chain_and_one_replica_costs_nothing() -> None:
    model = LINKS["nvlink + ib400"]
    assert streamed_chain_ms(model, 8e6, 4, pieces=1) == pytest.approx(whole_chain_ms(model, 8e6, 4))
    assert streamed_chain_ms(model, 8e6, 1) == ring_ms(model, 8e6, 1) == 0.0


@pytest.mark.parametrize("name", sorted(LINKS))
def test_the_streamed_chain_stays_within_2x_of_a_ring_up_to_1024_replicas(name: str) -> None:
    model = LINKS[name]
    for nbytes in (1e5, 1e6, 8e6, 32e6, 256e6):
        for replicas in (2, 3, 4, 8, 9, 16, 64, 256, 1024):
            ring = ring_ms(model, nbytes, replicas)
            assert streamed_chain_ms(model, nbytes, replicas) <= 2 * ring, (nbytes, replicas)
            assert streamed_chain_ms(model, nbytes, replicas) <= sequential_chain_ms(model, nbytes, replicas)
    # the whole-message chain grows with D: 64 MB over 1024 replicas is tens of times slower than the ring
    assert whole_chain_ms(model, 64e6, 1024) > 20 * ring_ms(model, 64e6, 1024)
