"""verify_report: two runs' results compared, the first divergence first, with its likely cause."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from lightning_naspipe.integration.verify_report import (CALLBACK_CAUSE, MISSING_LOG_CAUSE, OUTSIDE_CAUSE,
                                                         PROCESS_CAUSE, SEED_CAUSE, VerifyReport, compare_runs,
                                                         counts, digest)


def result(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "initial": {"supernet.w": digest(torch.zeros(2)), "extra": digest(torch.zeros(()))},
        "state": {"supernet.w": torch.tensor([1.0, 2.0]), "supernet.n": torch.tensor(3), "extra": torch.tensor(0.0)},
        "optimizers": [{"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}],
        "schedulers": [{"last_epoch": 4}],
        "callbacks": {"EMA": {"average": torch.ones(2)}},
        "logged": [(0, "loss", 1.0), (0, "epoch", 0.0), (1, "loss", 0.5), (1, "epoch", 0.0)],
        "global_step": 2,
    }
    base.update(changes)
    return base


def outside(name: str) -> bool:
    return not name.startswith("supernet.")


def test_equal_results_are_exact() -> None:
    differences = compare_runs(result(), copy.deepcopy(result()), outside_supernet=outside)
    report = VerifyReport(tuple(differences), counts(result()), "2 stages", 2)
    assert differences == [] and report.exact and report.first is None and report.exit_code == 0
    assert "exact" in report.summary() and "3 tensors" in report.summary()


def test_nan_equals_nan_and_a_changed_value_does_not() -> None:
    nan = result(logged=[(0, "loss", math.nan)])
    assert compare_runs(nan, copy.deepcopy(nan)) == []
    (difference,) = compare_runs(nan, result(logged=[(0, "loss", 1.0)]))
    assert (difference.kind, difference.name, difference.step) == ("logged", "loss", 0)


def test_different_initial_weights_name_the_seed_and_nothing_else() -> None:
    other = result(initial={"supernet.w": digest(torch.ones(2)), "extra": digest(torch.zeros(()))},
                   state={"supernet.w": torch.zeros(2)})
    differences = compare_runs(result(), other)
    assert [(d.kind, d.name, d.cause) for d in differences] == [("initial weights", "supernet.w", SEED_CAUSE)]


def test_a_digest_covers_dtype_shape_and_bits() -> None:
    assert digest(torch.zeros(2)) == digest(torch.zeros(2))
    assert len({digest(torch.zeros(2)), digest(torch.zeros(2, dtype=torch.float64)), digest(torch.zeros(1, 2)),
                digest(torch.tensor([0.0, -0.0]))}) == 4


def test_the_earliest_logged_difference_comes_first_and_a_first_step_one_names_the_process() -> None:
    other = result(logged=[(0, "loss", 1.0), (0, "epoch", 0.0), (1, "loss", 0.25), (1, "epoch", 0.0)],
                   state={**result()["state"], "supernet.w": torch.tensor([1.0, 2.5])})
    differences = compare_runs(result(), other, outside_supernet=outside, describe_step=lambda s: f"subnet {s}")
    assert [(d.kind, d.name, d.step) for d in differences] == [("logged", "loss", 1), ("tensor", "supernet.w", None)]
    assert "plain 0.5 vs pipelined 0.25 (subnet 1)" in differences[0].detail
    assert differences[0].cause is None  # step 1 is not the first: training went the same way until there
    at_first = result(logged=[(0, "loss", 2.0), (0, "epoch", 0.0), (1, "loss", 0.5), (1, "epoch", 0.0)])
    assert compare_runs(result(), at_first)[0].cause == PROCESS_CAUSE
    (tensor,) = compare_runs(result(), result(state={**result()["state"], "supernet.w": torch.tensor([1.0, 2.5])}))
    assert tensor.cause == PROCESS_CAUSE and "1 of 2 elements differ, max |difference| 0.5" in tensor.detail


def test_points_missing_on_the_pipelined_run_name_hooks_on_one_stage() -> None:
    fewer = result(logged=[(0, "loss", 1.0), (0, "epoch", 0.0), (1, "epoch", 0.0)])
    (difference,) = compare_runs(result(), fewer)
    assert (difference.name, difference.step, difference.cause) == ("loss", 1, MISSING_LOG_CAUSE)
    shifted = result(logged=[(1, "loss", 1.0), (0, "epoch", 0.0), (1, "loss", 0.5), (1, "epoch", 0.0)])
    (difference,) = compare_runs(result(), shifted)
    assert (difference.step, difference.cause) == (0, MISSING_LOG_CAUSE)


def test_ignored_names_and_the_strategys_own_accounting_are_not_compared() -> None:
    extra = result(logged=result()["logged"] + [(1, "telemetry/bubble_stage0", 0.3), (1, "time", 9.0)])
    assert [d.name for d in compare_runs(result(), extra)] == ["time"]
    assert compare_runs(result(), extra, ignore=["ti*"]) == []


def test_state_outside_the_supernet_is_named_first() -> None:
    other = result(state={"supernet.w": torch.tensor([1.0, 3.0]), "supernet.n": torch.tensor(3),
                          "extra": torch.tensor(5.0)})
    differences = compare_runs(result(), other, outside_supernet=outside)
    assert [(d.name, d.cause) for d in differences] == [("extra", OUTSIDE_CAUSE), ("supernet.w", None)]


def test_shape_dtype_and_missing_tensors_are_described() -> None:
    other = result(state={"supernet.w": torch.tensor([1.0, 2.0], dtype=torch.float64), "extra": torch.tensor(0.0),
                          "supernet.new": torch.zeros(1)})
    details = {d.name: d.detail for d in compare_runs(result(), other)}
    assert details == {"supernet.w": "plain torch.float32 (2,) vs pipelined torch.float64 (2,)",
                       "supernet.n": "only in the plain run", "supernet.new": "only in the pipelined run"}


def test_optimizer_scheduler_and_callback_states_are_compared_leaf_by_leaf() -> None:
    other = result(optimizers=[{"state": {0: {"exp_avg": torch.tensor([1.0, 0.0])}}, "param_groups": [{"lr": 0.2}]}],
                   schedulers=[{"last_epoch": 5}], callbacks={"EMA": {"average": torch.zeros(2)}, "New": {"n": 1}})
    found = [(d.kind, d.name, d.cause) for d in compare_runs(result(), other)]
    assert found == [("optimizer", "optimizers[0].state.0.exp_avg", None),
                     ("optimizer", "optimizers[0].param_groups[0].lr", None),
                     ("scheduler", "schedulers[0].last_epoch", None),
                     ("callback", "callbacks.EMA.average", CALLBACK_CAUSE),
                     ("callback", "callbacks.New", CALLBACK_CAUSE)]


def test_a_different_step_count_is_reported() -> None:
    assert [d.detail for d in compare_runs(result(), result(global_step=3))] == ["plain 2 vs pipelined 3"]


def test_the_summary_names_the_first_divergence_its_cause_and_counts_the_rest() -> None:
    other = result(logged=[(0, "loss", 9.0), (0, "epoch", 0.0), (1, "loss", 9.5), (1, "epoch", 0.0)],
                   state={"supernet.w": torch.zeros(2), "supernet.n": torch.tensor(4), "extra": torch.tensor(0.0)})
    report = VerifyReport(tuple(compare_runs(result(), other)), counts(result()), "2 stages", 2)
    text = report.summary()
    assert not report.exact and report.exit_code == 1
    assert "NOT exact: 1 logged, 2 tensor differ" in text
    assert "first divergence: logged 'loss' at step 0: plain 1.0 vs pipelined 9.0" in text
    assert f"likely cause: {PROCESS_CAUSE}" in text and "also: tensor 'supernet.w'" in text
