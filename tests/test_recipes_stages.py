"""Several subnets per step (gloo on CPU): the sandwich rule with in-place distillation, FairNAS and constrained
sampling give bitwise the plain Trainer's weights, buffers, Adam state and losses on 2 and 3 stages.

ToyNet (helpers.py; LNP_TEST_RECIPE picks its ``step_sampler``) has a trainable stem and head, BatchNorm, dropout
and a ``compute_loss`` with a ``teacher`` parameter, so every subnet of a step after the first learns from the
first one's detached output too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lightning_naspipe as lnp
from helpers import assert_same_state
from test_pipeline import _launch, _plain_state, _state

pytestmark = pytest.mark.slow


def _plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, chunks: int) -> dict[str, Any]:
    monkeypatch.setenv("LNP_TEST_RECIPE", recipe)
    strategy = lnp.NASPipeStrategy(window=8, chunks=chunks) if chunks > 1 else None
    return _plain_state(tmp_path, strategy=strategy, max_epochs=2)


@pytest.mark.parametrize("recipe, stages, chunks, space", [
    ("sandwich", 2, 1, "choices"), ("sandwich", 3, 2, "choices"), ("fairnas", 2, 2, "choices"),
    ("constrained", 3, 1, "choices"), ("sandwich", 2, 2, "elastic"), ("fairnas", 3, 1, "elastic")])
def test_a_recipe_on_stages_equals_the_plain_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str,
                                                     stages: int, chunks: int, space: str) -> None:
    """Candidate ops (ToyNet) and elastic widths with BatchNorm over elastic channels (its elastic twin)."""
    monkeypatch.setenv("LNP_TEST_SPACE", space)
    plain = _plain(tmp_path, monkeypatch, recipe, chunks)
    ckpt = _launch(tmp_path, "--devices", str(stages), "--window", "4", "--chunks", str(chunks),
                   LNP_TEST_RECIPE=recipe, LNP_TEST_SPACE=space)
    assert_same_state(plain, _state(ckpt))


def test_sandwich_resumes_onto_another_stage_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _plain(tmp_path, monkeypatch, "sandwich", 1)
    stop = _launch(tmp_path, "--devices", "2", "--window", "4", "--max-steps", "10", name="stop",
                   LNP_TEST_RECIPE="sandwich")
    resumed = _launch(tmp_path, "--devices", "3", "--window", "8", "--resume", str(stop), name="resumed",
                      LNP_TEST_RECIPE="sandwich")
    assert_same_state(plain, _state(resumed))
