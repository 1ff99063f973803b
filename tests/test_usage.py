"""Lightning habits against the plain Trainer: the scenarios of usage_scenarios.py, and clear refusals.

The in-process half of the compatibility matrix (docs/lightning.md): ``NASPipeStrategy`` on one stage
runs windows of subnets as several stages do, so every flag that counts batches and every resume point
is checked here against a plain one-device Trainer, bitwise, logged points included;
test_usage_stages.py runs the same scenarios on two stage processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import ToyNet, assert_same_state, full_state, pl, toy_loader, train, trainer_kwargs
from lightning_naspipe.errors import NASPipeConfigError
from usage_scenarios import RESUME_POINTS, SCENARIOS, fit, plain_results, selected_scenarios


def _same_as(reference: dict[str, Any], run: dict[str, Any], from_step: int = 0, validated: bool = True) -> None:
    """``run`` (perhaps resumed at ``from_step``) ends bitwise where ``reference`` does, with the same
    per-subnet losses, validation points and epoch means of the training loss from ``from_step`` on (and
    those at ``from_step - 1``, the last subnet's, unless its epoch ``validated`` before the checkpoint)."""
    expected = {**reference, "losses": {k: v for k, v in reference["losses"].items() if k >= from_step}}
    assert_same_state(expected, run)
    first = from_step if validated else from_step - 1

    def epoch_points(rows: list[Any]) -> list[Any]:
        return [row for row in rows if row[0] >= first and ("val_loss" in row[1] or "train_loss_epoch" in row[1])]

    assert epoch_points(run["rows"]) == epoch_points(reference["rows"]) != []


@pytest.fixture(scope="module")
def plain_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return plain_results(tmp_path_factory.mktemp("plain"), selected_scenarios(request))


def check_scenario(name: str, plain_runs: dict[str, dict[str, Any]], result: dict[str, Any]) -> None:
    """``result`` of scenario ``name`` is the plain run's: bitwise state and the same logged points (a
    resumed run: the uninterrupted plain run's from the checkpoint on)."""
    if name.startswith("resume: "):
        _, _, _, step, validated = RESUME_POINTS[name.removeprefix("resume: ")]
        _same_as(plain_runs["three epochs"], result, from_step=step, validated=validated)
        return
    reference = plain_runs[name]
    assert_same_state(reference, result)
    assert result["rows"] == reference["rows"]
    assert result.get("epoch_end_weights") == reference.get("epoch_end_weights")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_habit_gives_the_plain_result_with_windows(tmp_path: Path, plain_runs: dict[str, dict[str, Any]],
                                                        name: str) -> None:
    check_scenario(name, plain_runs, SCENARIOS[name](lambda: lnp.NASPipeStrategy(window=4), tmp_path))


@pytest.mark.parametrize("flags, match", [
    (dict(val_check_interval=0.5), r"val_check_interval=0.5.*window=1"),
    (dict(callbacks=[pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)]),
     r"StochasticWeightAveraging is not supported.*fine-tuning the exported subnet"),
], ids=["val_check_interval-fraction", "stochastic-weight-averaging"])
def test_flags_that_cannot_be_exact_are_refused_before_training(flags: dict[str, Any], match: str) -> None:
    with pytest.raises(NASPipeConfigError, match=match):
        fit(lambda: lnp.NASPipeStrategy(window=4), max_epochs=1, **flags)


def test_a_fraction_of_a_loader_without_length_is_refused_naming_the_fix() -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(toy_loader().dataset)

    with pytest.raises(NASPipeConfigError, match=r"limit_train_batches=0.5.*no length.*number of batches"):
        fit(lambda: lnp.NASPipeStrategy(window=4), loader=torch.utils.data.DataLoader(Stream(), batch_size=8),
            max_epochs=1, limit_train_batches=0.5)


def test_a_module_that_writes_its_own_training_step_is_refused_naming_compute_loss() -> None:
    class OwnStep(ToyNet):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.compute_loss(self.supernet(batch[0], self.sample_subnet(batch_idx)), batch)

    with pytest.raises(NASPipeConfigError, match=r"overrides training_step.*compute_loss"):
        pl.Trainer(**trainer_kwargs(max_epochs=1)).fit(OwnStep(), toy_loader())


def test_barebones_trains_as_the_plain_run_and_logs_nothing() -> None:
    flags = dict(barebones=True, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, max_epochs=2)
    plain_model, plain_trainer = train(**flags)
    model, trainer = train(lnp.NASPipeStrategy(window=4), **flags)
    assert_same_state(full_state(plain_model, plain_trainer), full_state(model, trainer))
