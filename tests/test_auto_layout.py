"""``num_stages="auto"``: what it profiles (nothing where one layout fits) and how it decides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch
import pytest
import pytorch_lightning
import yaml

import lightning_naspipe as lnp
from lightning_naspipe.integration.auto_layout import CPU_OVERHEADS, chosen_stages
from lightning_naspipe.planning.planner import best_layout, plan_layouts
from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec


def _stem_and_head(blocks: int = 4) -> SpaceSpec:
    """One micro-batch's costs of a space whose every subnet trains its stem and head: replicas win."""
    fixed = BlockSpec(None, [CandidateSpec(2.0, 4.0, True, grad_bytes=1000)])
    return SpaceSpec([fixed] + [BlockSpec(f"c{i}", [CandidateSpec(2.0, 4.0, True, grad_bytes=1000)] * 4)
                                for i in range(blocks - 2)] + [fixed])


def test_where_one_layout_fits_nothing_is_profiled() -> None:
    def profile(deferred: bool) -> SpaceSpec:
        raise AssertionError("profiled")

    stages, message, hparams = chosen_stages(profile, 2, 4, chunks=1, window=8, is_global_zero=True,
                                             broadcast=lambda v: v, device_type="cpu")
    assert stages == 2 and "2 stage(s) x 1 replica(s), the only layout of 2 processes that fits" in message
    assert hparams == {"naspipe/num_stages": 2, "naspipe/replicas": 1, "naspipe/layout_chosen_by": "only fit"}


def test_no_layout_that_fits_is_refused_naming_the_fix() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="no layout of 3 processes for 2 blocks.*num_stages=<int>"):
        chosen_stages(lambda deferred: _stem_and_head(), 3, 2, chunks=1, window=8, is_global_zero=True,
                      broadcast=lambda v: v, device_type="cpu")


@pytest.mark.parametrize("chunks, subnets, defer, deferred", [(2, 1, None, False), (1, 2, None, False),
                                                               (2, 1, True, True), (2, 1, False, False)])
def test_the_profile_times_the_deferred_passes_only_where_the_plan_uses_them(
        chunks: int, subnets: int, defer: bool | None, deferred: bool) -> None:
    asked: list[bool] = []

    def profile(passes: bool) -> SpaceSpec:
        asked.append(passes)
        return _stem_and_head()

    chosen_stages(profile, 2, 4, chunks, 8, True, lambda v: v, "cpu", subnets, defer)
    assert asked == [deferred]


def test_rank_zero_plans_on_the_micro_batch_costs_times_chunks_and_every_rank_takes_its_choice() -> None:
    micro = _stem_and_head()
    stages, message, hparams = chosen_stages(lambda deferred: micro, 2, 4, 2, 8, True, lambda v: v, "cpu")
    whole = dataclasses.replace(micro.compute_scaled(lambda ms: ms * 2), **CPU_OVERHEADS)
    predictions = plan_layouts(whole, 2, 8, 2)
    assert stages == best_layout(predictions).stages == 1
    rates = ", ".join(f"{p.stages} x {p.replicas}: {p.subnets_per_s:.1f}" for p in predictions)
    assert message.startswith("NASPipe: num_stages='auto' chose 1 stage(s) x 2 replica(s); predicted subnets/s per "
                              "stages x replicas: " + rates)
    assert hparams == {"naspipe/num_stages": 1, "naspipe/replicas": 2, "naspipe/layout_chosen_by": "planner",
                       "naspipe/predicted_rate": round(best_layout(predictions).subnets_per_s, 2),
                       "naspipe/predicted_rate_unit": "subnets/s", "naspipe/predicted_rates": rates}
    # Elsewhere: rank 0's choice, whatever this rank would have planned.
    assert chosen_stages(lambda deferred: micro, 2, 4, 2, 8, False, lambda v: (2, "rank 0's", {"a": 1}),
                         "cpu") == (2, "rank 0's", {"a": 1})


def test_on_cpu_heavy_gradients_keep_replicas_out_and_batch_norm_costs_them() -> None:
    """What the CPU overheads make of replicas (benchmarks/replica_update.py): a space of 8 blocks x 1 MB of gradients
    and 2.5 ms per subnet and block (the zoo's wide_mlp, where 2 replicas measured 0.77x one device and 2 stages
    1.33x) plans as 2 stages; the same space with a BatchNorm replay of half its compute plans replicas slower."""
    op = CandidateSpec(1.0, 1.5, True, grad_bytes=1_050_000, grad_tensors=2)
    wide = SpaceSpec([BlockSpec(f"b{i}", [op] * 32) for i in range(8)], **CPU_OVERHEADS)
    rates = {p.layout: p.subnets_per_s for p in plan_layouts(wide, 2, 8, 2)}
    assert best_layout(plan_layouts(wide, 2, 8, 2)).stages == 2 and rates["1x2"] < 0.75 * rates["2x1"]
    light = SpaceSpec([BlockSpec(f"b{i}", [dataclasses.replace(op, grad_bytes=1000)] * 4) for i in range(8)],
                      **CPU_OVERHEADS)
    replayed = SpaceSpec([BlockSpec(b.label, [dataclasses.replace(c, replay_ms=1.25, statistics_tensors=3)
                                              for c in b.candidates]) for b in light.blocks], **CPU_OVERHEADS)
    replicas = [next(p.subnets_per_s for p in plan_layouts(s, 2, 8, 2) if p.replicas == 2) for s in (light, replayed)]
    assert replicas[1] < 0.8 * replicas[0]


@pytest.mark.parametrize("namespace", [lightning.pytorch, pytorch_lightning])
def test_the_choice_as_hyperparameters_lands_in_a_csv_loggers_hparams_yaml(tmp_path: Path, namespace: Any) -> None:
    """What NASPipeStrategy hands every logger of the Trainer on rank 0 (pipeline_build._chosen_layout)."""
    _, _, hparams = chosen_stages(lambda deferred: _stem_and_head(), 2, 4, 2, 8, True, lambda v: v, "cpu")
    logger = namespace.loggers.CSVLogger(tmp_path, name="", version="")
    logger.log_hyperparams({"lr": 0.05})  # the module's, logged by the Trainer before the first batch
    logger.log_hyperparams(hparams)
    logger.save()
    saved = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert saved == {"lr": 0.05, **hparams} and saved["naspipe/num_stages"] == 1 and saved["naspipe/replicas"] == 2
