"""The compatibility matrix on two stage processes: every scenario of usage_scenarios.py under
``NASPipeStrategy`` on 2 stages equals the plain Trainer, bitwise, logged points included.

The selected scenarios (all, unless ``-k`` picks some) run in one launch (the processes import Lightning once);
the plain runs are in process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from test_pipeline import run_ranks, torchrun_env
from test_usage import check_scenario
from usage_scenarios import SCENARIOS, plain_results, selected_scenarios

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("usage_run.py")


@pytest.fixture(scope="module")
def plain_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return plain_results(tmp_path_factory.mktemp("plain"), selected_scenarios(request))


@pytest.fixture(scope="module")
def two_stage_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("stages")
    names = selected_scenarios(request)  # those this session tests: all unless -k picks some
    run_ranks(out, SCRIPT, ["--out", str(out), *names], torchrun_env(2), timeout=600)
    return {name: torch.load(out / f"{index}.result", weights_only=False) for index, name in enumerate(names)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_habit_gives_the_plain_result_on_two_stages(plain_runs: dict[str, dict[str, Any]],
                                                         two_stage_results: dict[str, Any], name: str) -> None:
    check_scenario(name, plain_runs, two_stage_results[name])
