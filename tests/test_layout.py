"""Stages x replicas: stage-major ranks (replica-major across nodes), contiguous micro-batch shares, and the
layouts refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.placement.layout import Layout


def test_ranks_are_stage_major() -> None:
    layout = Layout.of(6, 3)
    assert (layout.stages, layout.replicas) == (3, 2)
    assert layout.replica_ranks(1) == [2, 3] and layout.column(1) == [1, 3, 5]
    assert [(layout.stage_of(r), layout.replica_of(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert layout.name(3) == "stage 1 replica 1 (rank 3)" and Layout.of(3, None).name(2) == "stage 2 (rank 2)"


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4))
def test_the_replicas_share_every_micro_batch_once_in_order(stages: int, replicas: int, per_replica: int) -> None:
    layout = Layout.of(stages * replicas, stages)
    chunks = replicas * per_replica
    shares = [layout.chunk_share(chunks, r) for r in range(replicas)]
    assert [c for share in shares for c in share] == list(range(chunks))
    for rank in range(layout.world_size):
        assert layout.rank(layout.stage_of(rank), layout.replica_of(rank)) == rank


@pytest.mark.parametrize(("world", "stages", "nodes"), [(4, 2, 1), (4, 2, 2), (8, 2, 2), (8, 4, 2), (8, 2, 4),
                                                       (12, 3, 2), (12, 2, 3), (8, 4, 4), (4, 4, 2), (6, 2, 3)])
def test_every_rank_once_and_pipelines_inside_a_node_where_the_stages_fit(world: int, stages: int,
                                                                         nodes: int) -> None:
    layout = Layout.of(world, stages, nodes)
    ranks = [layout.rank(s, d) for d in range(layout.replicas) for s in range(layout.stages)]
    assert sorted(ranks) == list(range(world))
    assert all(layout.rank(layout.stage_of(r), layout.replica_of(r)) == r for r in range(world))
    fits = (world // nodes) % stages == 0
    assert layout.pipelines_in_nodes == fits and layout.replica_major == (fits and nodes > 1)
    if fits:  # each node runs whole pipelines, and a stage's replicas are spread over every node
        assert all({layout.node_of(r) for r in layout.replica_ranks(s)} == set(range(nodes)) for s in range(stages))


def test_two_nodes_of_two_run_one_pipeline_each() -> None:
    layout = Layout.of(4, 2, nodes=2)
    assert layout.column(0) == [0, 1] and layout.column(1) == [2, 3] and layout.replica_ranks(1) == [1, 3]
    assert layout.name(2) == "stage 0 replica 1 (rank 2)"
    assert Layout.of(4, 2, nodes=1).column(1) == [1, 3]  # one node: stage-major, as before


def test_nodes_must_divide_the_processes() -> None:
    with pytest.raises(NASPipeConfigError, match=r"on num_nodes=3: .*num_nodes must divide 4; use one of \[1, 2, 4\]"):
        Layout.of(4, 2, nodes=3)


def test_num_stages_must_divide_the_processes() -> None:
    assert Layout.of(4, None) == Layout(4, 1)
    with pytest.raises(NASPipeConfigError, match=r"num_stages=3\) with 4 processes.*use one of \[1, 2, 4\]"):
        Layout.of(4, 3)
    with pytest.raises(NASPipeConfigError, match="num_stages must divide 2"):
        Layout.of(2, 4)


def test_chunks_must_be_a_multiple_of_the_replicas() -> None:
    layout = Layout.of(4, 2)
    layout.check_chunks(4)
    with pytest.raises(NASPipeConfigError, match=r"chunks=3\) with 2 replicas.*multiple of 2, e\.g\. \[2, 4, 6\]"):
        layout.chunk_share(3, 0)


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5))
def test_a_step_of_several_subnets_is_shared_subnet_by_subnet(replicas: int, chunks: int, subnets: int) -> None:
    layout = Layout.of(2 * replicas, 2)
    if chunks * subnets % replicas:
        steps = rf" x {subnets} subnets per training step" if subnets > 1 else ""
        with pytest.raises(NASPipeConfigError, match=rf"chunks={chunks}\){steps} with {replicas} replicas"):
            layout.chunk_share(chunks, 0, subnets)
        return
    shares = [layout.chunk_share(chunks, r, subnets) for r in range(replicas)]
    assert [m for share in shares for m in share] == list(range(chunks * subnets))


def test_four_subnets_per_step_share_one_chunk_on_two_replicas() -> None:
    assert Layout.of(2, 1).chunk_share(1, 1, 4) == range(2, 4)
    with pytest.raises(NASPipeConfigError, match="or train a multiple of 2 subnets per step"):
        Layout.of(2, 1).check_chunks(1, 3)
