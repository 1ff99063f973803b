from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.runtime.optim import module_parameters, restrict_param_groups, step_schedulers


def test_restricted_step_touches_only_given_parameters() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.Adam([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.5}])
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.ones_like(p)  # another in-flight subnet's gradients sit on b
    b_before = [p.clone() for p in b.parameters()]
    with restrict_param_groups(optimizer, a.parameters()):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), b_before))
    assert all(p not in optimizer.state for p in b.parameters())
    assert all(optimizer.state[p]["step"] == 1 for p in a.parameters())
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]  # restored


def test_module_parameters_dedupes_and_skips_frozen() -> None:
    shared = nn.Linear(2, 2)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    params = module_parameters([shared, nn.Sequential(shared, frozen)])
    assert [id(p) for p in params] == [id(p) for p in shared.parameters()]


def _config(scheduler: object, interval: str = "step", frequency: int = 1, monitor: str | None = None) -> object:
    return SimpleNamespace(scheduler=scheduler, interval=interval, frequency=frequency, monitor=monitor)


def test_step_schedulers_respects_interval_and_frequency() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    configs = [_config(scheduler, "step", frequency=2)]
    step_schedulers(configs, "epoch", 2, {})
    step_schedulers(configs, "step", 1, {})
    assert optimizer.param_groups[0]["lr"] == 1.0
    step_schedulers(configs, "step", 2, {})
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_plateau_scheduler_needs_epoch_interval_and_a_logged_metric() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(lnp.NASPipeConfigError, match="interval='epoch'"):
        step_schedulers([_config(plateau, "step", monitor="val_loss")], "step", 1, {})
    with pytest.raises(lnp.NASPipeConfigError, match="val_loss"):
        step_schedulers([_config(plateau, "epoch", monitor="val_loss")], "epoch", 1, {})
    step_schedulers([_config(plateau, "epoch", monitor="val_loss")], "epoch", 1, {"val_loss": torch.tensor(1.0)})


def test_restriction_follows_edited_param_groups() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(a.parameters(), lr=1.0)
    with restrict_param_groups(optimizer, a.parameters()):
        pass
    optimizer.param_groups[0]["params"] = list(b.parameters())  # same sizes, other tensors
    with restrict_param_groups(optimizer, b.parameters()):
        assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in b.parameters()]
