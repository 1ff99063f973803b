from __future__ import annotations

import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.placement.stage_table import chunks_hint, serialising_blocks, stage_table
from lightning_naspipe.space.supernet import describe


def test_describe_names_structure_dtypes_and_shapes() -> None:
    x = torch.zeros(2, 3)
    assert describe(x) == "float32[2, 3]"
    assert describe((x, x, x, torch.arange(2), None)) == "tuple(float32[2, 3] x3, int64[2], NoneType)"
    assert describe({"h": x, "n": 3}) == "dict(h: float32[2, 3], n: int)"


def test_table_has_a_row_per_stage_with_its_blocks_labels_parameters_cost_and_sends() -> None:
    net = lnp.Supernet(nn.Linear(2, 4), lnp.ChoiceBlock([nn.Linear(4, 4), nn.Identity()], label="a"),
                       nn.Sequential(nn.Linear(4, 4), lnp.ChoiceBlock([nn.Tanh(), nn.ReLU()], label="b")))
    table = stage_table(net, [range(0, 2), range(2, 3)], [1.0, 2.0, 1.0], "ms", ["float32[8, 4]", None])
    rows = [[cell.strip() for cell in line.split("|")] for line in table.splitlines()]
    assert rows[0] == ["stage", "blocks", "labels", "parameters", "cost", "sends to the next stage"]
    assert rows[1] == ["0", "0-1", "a", "32", "75% (ms)", "float32[8, 4]"]
    assert rows[2] == ["1", "2-2", "b", "20", "25% (ms)", "-"]
    one_rank_each = stage_table(net, [range(0, 2), range(2, 3)], [1.0, 2.0, 1.0], "ms", ["float32[8, 4]", None],
                                [[0], [1]])
    assert one_rank_each == table  # no ranks column without replicas

def test_replicas_are_named_by_their_ranks() -> None:
    net = lnp.Supernet(nn.Linear(2, 4), nn.Linear(4, 4))
    table = stage_table(net, [range(0, 1), range(1, 2)], [1.0, 1.0], "params", ["float32[8, 4]", None],
                        [[0, 1], [2, 3]])
    rows = [[cell.strip() for cell in line.split("|")] for line in table.splitlines()]
    assert rows[0][:3] == ["stage", "ranks", "blocks"] and rows[1][:3] == ["0", "0, 1", "0-0"]
    assert rows[2][:3] == ["1", "2, 3", "1-1"]


def test_a_hint_names_the_blocks_that_serialise_every_stage_at_chunks_1() -> None:
    net = lnp.Supernet(nn.Linear(2, 4), lnp.ChoiceBlock([nn.Linear(4, 4), nn.Identity()]), nn.ReLU(),
                       nn.Sequential(nn.LayerNorm(4), lnp.ChoiceBlock([nn.Tanh(), nn.ReLU()])))
    assert serialising_blocks(net, range(4)) == [0, 3]  # a choice's candidates and parameter-free blocks do not
    hint = chunks_hint(net, [range(0, 2), range(2, 4)], chunks=1)
    assert hint is not None and "stage 0: block(s) 0; stage 1: block(s) 3" in hint and "chunks=4" in hint
    assert chunks_hint(net, [range(0, 2), range(2, 4)], chunks=2) is None
    assert chunks_hint(net, [range(0, 1), range(1, 3), range(3, 4)], chunks=1) is None  # stage 1 overlaps subnets
