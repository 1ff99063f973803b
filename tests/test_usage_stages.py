"""The compatibility matrix on two stage processes: every scenario of usage_scenarios.py under
``NASPipeStrategy`` on 2 stages equals the plain Trainer, bitwise, logged points included; issue 41's habits also
on 1 stage x 2 replicas.

The selected scenarios (all, unless ``-k`` picks some) run in one launch (the processes import Lightning once);
the plain runs are in process.
"""

from __future__ import annotations

import os
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


#: Issue 41's habits, also on 1 stage x 2 replicas: the module sets chunks = 2 (LNP_TEST_CHUNKS), so the plain
#: Trainer splits each batch as the replicas share it.
ON_REPLICAS = ["random and np.random in blocks and compute_loss", "self.log in compute_loss",
               "OneCycleLR(total_steps=estimated_stepping_batches)", "DeviceStatsMonitor",
               "self.log in on_train_batch_start", "LearningRateMonitor"]


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    os.environ["LNP_TEST_CHUNKS"] = "2"
    try:
        plain = plain_results(tmp_path_factory.mktemp("plain_chunks2"), ON_REPLICAS)
    finally:
        del os.environ["LNP_TEST_CHUNKS"]
    out = tmp_path_factory.mktemp("replicas")
    ranks = [{**rank, "LNP_TEST_CHUNKS": "2"} for rank in torchrun_env(2)]
    run_ranks(out, SCRIPT, ["--out", str(out), "--num-stages", "1", *ON_REPLICAS], ranks, timeout=600)
    return plain, {name: torch.load(out / f"{index}.result", weights_only=False)
                   for index, name in enumerate(ON_REPLICAS)}


@pytest.mark.parametrize("habit", ON_REPLICAS)
def test_issue_41_habits_give_the_plain_result_on_replicas(replica_runs: tuple[dict[str, Any], dict[str, Any]],
                                                           habit: str) -> None:
    plain, replicas = replica_runs
    check_scenario(habit, plain, replicas[habit])
