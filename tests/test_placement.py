from __future__ import annotations

from lightning_naspipe.pipeline.placement.moves import owner_of, rebalanced


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


def test_many_small_blocks_walk_the_cut_toward_balance_and_stop_there() -> None:
    """20 equal blocks, one stage measured 61% busy: each check moves one block (each ~5% of a stage, below a
    fixed 10% bar), until a further move would make the other stage the bottleneck."""
    ranges, weights = [range(0, 10), range(10, 20)], [1.0] * 20
    busy = [39.0, 61.0]
    cuts = []
    for _ in range(6):
        moved = rebalanced(ranges, busy, weights)
        if moved is None:
            break
        # the measured times follow the blocks: 5 (of 100) per block, stage 1's blocks 6.1 each before
        per_block = [busy[s] / len(ranges[s]) for s in range(2)]
        shift = moved[0].stop - ranges[0].stop
        busy = [busy[0] + shift * per_block[1], busy[1] - shift * per_block[1]]
        ranges = moved
        cuts.append(ranges[0].stop)
    assert cuts == [11, 12] and abs(busy[0] - busy[1]) < 6.1
    assert rebalanced(ranges, busy, weights) is None  # balanced: stays
