"""Stages x data-parallel replicas (gloo on CPU): bitwise the plain one-device Trainer with the same chunks.

ToyNet (helpers.py) has a trainable stem and head, BatchNorm, dropout and Adam; with ``chunks=4`` each
replica trains its contiguous share of every batch's micro-batches and the replicas chain their sums in
micro-batch order (lightning_naspipe/pipeline/replicas.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import assert_same_state
from test_pipeline import _launch, _plain_state, _state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain_chunks4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _plain_state(tmp_path_factory.mktemp("plain4"), strategy=lnp.NASPipeStrategy(window=8, chunks=4),
                        max_epochs=2)


@pytest.mark.parametrize("devices, stages", [(2, 1), (4, 2)])
def test_replicas_equal_the_plain_trainer(tmp_path: Path, plain_chunks4: dict, devices: int, stages: int) -> None:
    ckpt = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--window", "4",
                   "--chunks", "4")
    assert_same_state(plain_chunks4, _state(ckpt))
    for rank in range(devices):  # every rank holds the whole trained supernet after fit
        weights = torch.load(f"{ckpt}.rank{rank}")
        assert all(torch.equal(weights[k], plain_chunks4["model"][k]) for k in plain_chunks4["model"])
