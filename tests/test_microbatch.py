from __future__ import annotations

import pytest
import torch

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.runtime.microbatch import split_batch


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


def test_batch_sizes_of_a_plain_loader() -> None:
    from torch.utils.data import DataLoader

    from lightning_naspipe.pipeline.runtime.microbatch import batch_sizes

    assert batch_sizes(DataLoader(list(range(10)), batch_size=4)) == {4, 2}
    assert batch_sizes(DataLoader(list(range(10)), batch_size=4, drop_last=True)) == {4}
    assert batch_sizes(DataLoader(list(range(3)), batch_size=8)) == {3}
    assert batch_sizes(object()) == set()


@pytest.mark.parametrize("samples, chunks, batchnorm, needle", [
    (97, 4, False, r"chunks=4\) splits every batch .* \[1, 8\] samples .*len\(dataset\)=97, batch_size=8"),
    (98, 2, True, r"micro-batch can hold 1 sample.*BatchNorm1d"),
    (98, 1, True, None),  # batches of 2: fine for BatchNorm
    (97, 1, False, None),
])
def test_bad_batch_sizes_fail_at_fit_start(samples: int, chunks: int, batchnorm: bool, needle: str | None) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_naspipe as lnp
    from helpers import CLASSES, FEATURES, ToyNet, trainer_kwargs

    model = ToyNet()  # its "shared" choice has a BatchNorm1d candidate
    if not batchnorm:
        model.supernet = lnp.Supernet(torch.nn.Linear(FEATURES, 8), lnp.ChoiceBlock([torch.nn.Tanh(), torch.nn.ReLU()]),
                                      torch.nn.Linear(8, CLASSES))
    data = DataLoader(TensorDataset(torch.randn(samples, FEATURES), torch.zeros(samples, dtype=torch.long)),
                      batch_size=8)
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=4, chunks=chunks), max_steps=2))
    if needle is None:
        trainer.fit(model, data)
    else:
        with pytest.raises(lnp.NASPipeConfigError, match=needle):
            trainer.fit(model, data)
        assert trainer.global_step == 0  # before any training


def test_per_sample_values_outside_tensors_are_refused() -> None:
    x = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(lnp.NASPipeConfigError, match="list of 4 non-tensor values .*chunks=1"):
        split_batch((x, ["a", "b", "c", "d"]), 2)
    pieces = split_batch({"x": x, "meta": ("train", 7)}, 2)  # shared values that are not per sample: kept whole
    assert [p["meta"] for p, _ in pieces] == [("train", 7), ("train", 7)]

