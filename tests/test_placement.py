from __future__ import annotations

from lightning_naspipe.pipeline.placement import owner_of, rebalanced


def test_owner_of_finds_the_stage_holding_a_block() -> None:
    assert [owner_of([range(0, 2), range(2, 5)], i) for i in range(5)] == [0, 0, 1, 1, 1]


def test_the_bottleneck_gives_its_edge_block_to_the_less_busy_neighbour() -> None:
    ranges = [range(0, 2), range(2, 5), range(5, 6)]
    weights = [1.0] * 6
    assert rebalanced(ranges, [1.0, 3.0, 2.5], weights) == [range(0, 3), range(3, 5), range(5, 6)]
    assert rebalanced(ranges, [2.5, 3.0, 1.0], weights) == [range(0, 2), range(2, 4), range(4, 6)]


def test_no_move_when_it_would_not_relieve_the_bottleneck_clearly() -> None:
    ranges = [range(0, 2), range(2, 4)]
    assert rebalanced(ranges, [1.0, 1.05], [1.0] * 4) is None  # balanced within the margin
    assert rebalanced(ranges, [1.0, 2.0], [0.1, 0.1, 5.0, 5.0]) is None  # the edge block is half of stage 1:
    # moving it makes stage 0 the new bottleneck at 2.0


def test_tied_cuts_and_single_block_stages_are_respected() -> None:
    assert rebalanced([range(0, 2), range(2, 5)], [1.0, 3.0], [1.0] * 5, forbidden=frozenset({3})) is None
    assert rebalanced([range(0, 4), range(4, 5)], [1.0, 3.0], [1.0] * 5) is None  # stage 1 has one block left
