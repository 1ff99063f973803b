from __future__ import annotations

import pytest
import torch

import lightning_naspipe as lnp
from lightning_naspipe.microbatch import split_batch


def test_one_chunk_returns_the_batch_itself() -> None:
    batch = (torch.ones(3, 2), torch.zeros(3))
    [(piece, weight)] = split_batch(batch, 1)
    assert piece is batch and weight == 1.0


def test_split_along_first_dim_with_weights() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5), "name": "digits"}
    pieces = split_batch(batch, 2)
    assert [w for _, w in pieces] == [3 / 5, 2 / 5]
    assert torch.equal(torch.cat([p["x"] for p, _ in pieces]), batch["x"])
    assert all(p["name"] == "digits" for p, _ in pieces)


@pytest.mark.parametrize("batch, needle", [
    ((torch.ones(1, 2),), "cannot be split"),
    ((torch.ones(4, 2), torch.ones(3)), "first dimensions"),
    (("text",), "none"),
])
def test_unsplittable_batches(batch: object, needle: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=needle):
        split_batch(batch, 2)
