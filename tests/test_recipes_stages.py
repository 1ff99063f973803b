"""Several subnets per step (gloo on CPU): the sandwich rule with in-place distillation, FairNAS and constrained
sampling give bitwise the plain Trainer's weights, buffers, Adam state and losses on 2 and 3 stages, at chunks 1
and 2, on a candidate-op space and on an elastic one: the whole grid, each cell its own run.

ToyNet (helpers.py; LNP_TEST_RECIPE picks its ``step_sampler``) has a trainable stem and head, BatchNorm, dropout
and a ``compute_loss`` with a ``teacher`` parameter, so every subnet of a step after the first learns from the
first one's detached output too. LNP_TEST_SPACE=elastic swaps in its elastic twin (widths sliced from shared
weights, BatchNorm over elastic channels).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import lightning_naspipe as lnp
from helpers import assert_same_state
from test_pipeline import SCRIPT, _env, _launch, _plain_state, _state

pytestmark = pytest.mark.slow

RECIPES, STAGES, CHUNKS, SPACES = ("sandwich", "fairnas", "constrained"), (2, 3), (1, 2), ("choices", "elastic")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int, str], dict[str, Any]]:
    """The plain Trainer's result per (recipe, chunks, space), trained once and shared by both stage counts."""
    cache: dict[tuple[str, int, str], dict[str, Any]] = {}

    def run(recipe: str, chunks: int, space: str) -> dict[str, Any]:
        if (recipe, chunks, space) not in cache:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("LNP_TEST_RECIPE", recipe)
                env.setenv("LNP_TEST_SPACE", space)
                strategy = lnp.NASPipeStrategy(window=8, chunks=chunks) if chunks > 1 else None
                cache[recipe, chunks, space] = _plain_state(tmp_path_factory.mktemp("plain"), strategy=strategy,
                                                            max_epochs=2)
        return cache[recipe, chunks, space]

    return run


@pytest.mark.parametrize("recipe, stages, chunks, space", list(itertools.product(RECIPES, STAGES, CHUNKS, SPACES)))
def test_a_recipe_on_stages_equals_the_plain_trainer(tmp_path: Path, plain: Callable[[str, int, str], dict[str, Any]],
                                                     recipe: str, stages: int, chunks: int, space: str) -> None:
    expected = plain(recipe, chunks, space)
    ckpt = _launch(tmp_path, "--devices", str(stages), "--window", "4", "--chunks", str(chunks),
                   LNP_TEST_RECIPE=recipe, LNP_TEST_SPACE=space)
    assert_same_state(expected, _state(ckpt))


@pytest.mark.parametrize("space", SPACES)
def test_sandwich_resumes_onto_another_stage_count(tmp_path: Path, plain: Callable[[str, int, str], dict[str, Any]],
                                                   space: str) -> None:
    stop = _launch(tmp_path, "--devices", "2", "--window", "4", "--max-steps", "10", name="stop",
                   LNP_TEST_RECIPE="sandwich", LNP_TEST_SPACE=space)
    resumed = _launch(tmp_path, "--devices", "3", "--window", "8", "--resume", str(stop), name="resumed",
                      LNP_TEST_RECIPE="sandwich", LNP_TEST_SPACE=space)
    assert_same_state(plain("sandwich", 1, space), _state(resumed))



@pytest.mark.parametrize("recipe, space, devices, stages", [
    ("sandwich", "choices", 2, 1), ("sandwich", "elastic", 2, 1), ("sandwich", "elastic", 4, 2),
    ("fairnas", "elastic", 4, 2), ("constrained", "choices", 4, 2)])
def test_a_recipe_on_replicas_equals_the_plain_trainer(tmp_path: Path, plain: Callable[[str, int, str], dict[str, Any]],
                                                       recipe: str, space: str, devices: int, stages: int) -> None:
    """Chunks 2 on 2 replicas: a step's micro-batches (3 subnets x 2 pieces with the sandwich rule) are shared
    subnet by subnet, so replica 1 starts inside the second subnet and needs the teacher replica 0 computed;
    the elastic space has BatchNorm over elastic channels, whose running statistics the replicas replay."""
    ckpt = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--window", "4", "--chunks", "2",
                   LNP_TEST_RECIPE=recipe, LNP_TEST_SPACE=space)
    assert_same_state(plain(recipe, 2, space), _state(ckpt))


def test_sandwich_on_two_by_two_resumes_onto_replicas_alone(tmp_path: Path,
                                                           plain: Callable[[str, int, str], dict[str, Any]]) -> None:
    stop = _launch(tmp_path, "--devices", "4", "--num-stages", "2", "--window", "4", "--chunks", "2",
                   "--max-steps", "10", name="stop", LNP_TEST_RECIPE="sandwich", LNP_TEST_SPACE="elastic")
    resumed = _launch(tmp_path, "--devices", "2", "--num-stages", "1", "--window", "8", "--chunks", "2",
                      "--resume", str(stop), name="resumed", LNP_TEST_RECIPE="sandwich", LNP_TEST_SPACE="elastic")
    assert_same_state(plain("sandwich", 2, "elastic"), _state(resumed))


@pytest.mark.parametrize("devices, stages", [(2, 1), (4, 2)])
def test_four_subnets_per_step_share_chunks_1_on_two_replicas(tmp_path: Path,
                                                             plain: Callable[[str, int, str], dict[str, Any]],
                                                             devices: int, stages: int) -> None:
    """``Sandwich(2)`` at the default ``chunks=1``: each of 2 replicas trains 2 whole subnets of every step."""
    ckpt = _launch(tmp_path, "--devices", str(devices), "--num-stages", str(stages), "--window", "4",
                   LNP_TEST_RECIPE="sandwich4", LNP_TEST_SPACE="elastic")
    assert_same_state(plain("sandwich4", 1, "elastic"), _state(ckpt))


def test_auto_layout_plans_steps_of_four_subnets_on_replicas_too(
        tmp_path: Path, plain: Callable[[str, int, str], dict[str, Any]]) -> None:
    """At chunks 1 only the subnets of a step make 2 replicas possible: the planner weighs that layout too."""
    stderr = _launch(tmp_path, "--devices", "2", "--num-stages", "auto", "--window", "4", keep_stderr=True,
                     LNP_TEST_RECIPE="sandwich4", LNP_TEST_SPACE="elastic")
    assert "predicted training steps/s (4 subnets each) per stages x replicas: 1 x 2:" in stderr, stderr[-3000:]
    assert_same_state(plain("sandwich4", 1, "elastic"), _state(tmp_path / "run.ckpt"))


def test_a_step_the_replicas_cannot_share_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "bad.ckpt"), "--devices", "2",
                           "--num-stages", "1"], env={**_env(), "LNP_TEST_RECIPE": "sandwich"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "(chunks=1) x 3 subnets per training step with 2 replicas" in proc.stderr, proc.stderr[-3000:]
