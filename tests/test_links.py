"""The planner's link model (lightning_naspipe/planning/links.py): the streamed exact reduction against a ring
all-reduce, where node boundaries fall, and layouts planned on several nodes (planning/nodes.py)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_naspipe.planning.links import (LINKS, Link, LinkModel, ring_ms, sequential_chain_ms,
                                              streamed_chain_ms, whole_chain_ms)
from lightning_naspipe.planning.planner import best_layout, plan_layouts, simulate
from lightning_naspipe.planning.space_spec import SpaceSpec, wide_spec


def test_hops_cross_nodes_where_ranks_do() -> None:
    model = LinkModel(Link(100.0, 1.0), Link(10.0, 5.0), per_node=4)
    assert model.hops(6, first_rank=0) == [model.intra] * 3 + [model.inter, model.intra]
    assert model.hops(3, first_rank=2) == [model.intra, model.inter]


def test_one_host_links_cost_what_the_spec_measured_per_message_and_per_mb() -> None:
    """``LinkModel.uniform(latency_ms, ms_per_mb)``: a message of ``n`` MB costs ``latency_ms + n * ms_per_mb`` (a 1000x
    fast link once made every CPU reduction nearly free, and num_stages="auto" chose replicas for 8 MB updates)."""
    link = LinkModel.uniform(0.25, 1.5).intra
    assert link.ms(2_000_000) == pytest.approx(0.25 + 2 * 1.5)
    assert LinkModel.uniform(0.25, 0.0).intra.ms(10**9) == pytest.approx(0.25)


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


def _gradient_heavy_space() -> SpaceSpec:
    """Eight choice blocks of 1 ms, 2 MB of gradients per candidate, stage messages of 0.05 ms on one host."""
    spec = dataclasses.replace(wide_spec(2, 8, 1.0), message_ms=0.05)
    for block in spec.blocks:
        block.candidates = [dataclasses.replace(c, grad_bytes=2_000_000) for c in block.candidates]
    return spec


#: Fast inside a node, 10 GB/s and 2 ms per message between nodes.
_TWO_TIERS = LinkModel(Link(100.0, 5.0), Link(10.0, 2000.0))


def test_on_two_nodes_the_planner_keeps_each_pipeline_inside_a_node() -> None:
    """One node: one stage x 4 replicas is fastest. Two nodes of two: that reduction crosses nodes, as would every
    stage message of 4 x 1; 2 x 2 puts a whole pipeline on each node and wins."""
    spec = _gradient_heavy_space()
    one = {p.layout: p for p in plan_layouts(spec, 4, 8, 4, links=_TWO_TIERS, nodes=1, subnets=16)}
    two = {p.layout: p for p in plan_layouts(spec, 4, 8, 4, links=_TWO_TIERS, nodes=2, subnets=16)}
    assert best_layout(list(one.values())).layout == "1x4" and best_layout(list(two.values())).layout == "2x2"
    assert all(two[k].makespan_ms > one[k].makespan_ms for k in ("1x4", "2x2", "4x1"))
    # 2 x 2 pays only its reduction across nodes: its stage messages cost what they cost on one node.
    flat = LinkModel(_TWO_TIERS.intra, _TWO_TIERS.intra)
    assert simulate(spec, 2, 8, 4, replicas=2, links=flat, nodes=2, subnets=16).makespan_ms == one["2x2"].makespan_ms


def test_nodes_that_do_not_divide_the_processes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"nodes=3 must divide the 4 processes"):
        simulate(wide_spec(2, 4, 1.0), 2, 4, 2, replicas=2, nodes=3)


def test_plan_cli_takes_nodes_and_refuses_those_that_do_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_naspipe.__main__ import main

    assert main(["plan", "--wide", "2", "--blocks", "4", "--processes", "4", "--chunks", "4", "--nodes", "2",
                 "--subnets", "8"]) == 0
    assert "best layout for 4 processes on 2 nodes (nvlink + ib400):" in capsys.readouterr().out
    assert main(["plan", "--wide", "2", "--processes", "4", "--nodes", "3"]) == 2
    assert "--nodes 3 needs --processes P that it divides" in capsys.readouterr().err
    assert main(["plan", "--wide", "2", "--nodes", "2"]) == 2
    assert "got --processes None" in capsys.readouterr().err
