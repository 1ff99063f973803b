"""Several subnets per step: the samplers (pure functions of seed and step), and one step of the engine against
the recipe written out in plain torch (the sandwich rule with in-place distillation, one optimizer step)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.step_sampling import (
    covers_every_candidate, parameter_counts, subnet_parameters,
)


def _space(candidates: int = 3, labels: int = 2) -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(nn.Linear(4, 6), *[lnp.ChoiceBlock([nn.Sequential(nn.Linear(6, 6 * (k + 1)), nn.Tanh(),
                                                                         nn.Linear(6 * (k + 1), 6))
                                                           for k in range(candidates)]) for _ in range(labels)],
                        nn.Linear(6, 3))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(1, 3), st.integers(0, 10_000), st.integers(0, 10_000))
def test_fairnas_trains_every_candidate_of_every_choice_once_per_step(candidates: int, labels: int, seed: int,
                                                                      step: int) -> None:
    supernet = lnp.Supernet(*[lnp.ChoiceBlock([nn.Identity() for _ in range(candidates)]) for _ in range(labels)])
    chosen = lnp.FairNAS()(supernet, seed, step)
    assert len(chosen) == candidates and covers_every_candidate(chosen, supernet.labels)
    assert chosen == lnp.FairNAS()(supernet, seed, step)  # a pure function of (seed, step)


def test_fairnas_refuses_choices_of_different_sizes() -> None:
    supernet = lnp.Supernet(lnp.ChoiceBlock([nn.Identity(), nn.Tanh()]), lnp.ChoiceBlock([nn.Identity()] * 3))
    with pytest.raises(lnp.NASPipeConfigError, match="every choice needs as many candidates"):
        lnp.FairNAS()(supernet, 0, 0)


def test_sandwich_trains_the_largest_the_smallest_and_uniform_subnets() -> None:
    supernet = _space()
    label = next(iter(supernet.labels))
    assert parameter_counts(supernet, label) == sorted(parameter_counts(supernet, label))  # candidate k is wider
    chosen = lnp.Sandwich(2)(supernet, 5, 17)
    assert chosen[0] == {name: 2 for name in supernet.labels} and chosen[1] == {name: 0 for name in supernet.labels}
    assert len(chosen) == 4 and chosen == lnp.Sandwich(2)(supernet, 5, 17)
    assert lnp.Sandwich(2)(supernet, 5, 18)[2:] != chosen[2:] or lnp.Sandwich(2)(supernet, 5, 19)[2:] != chosen[2:]
    with pytest.raises(lnp.NASPipeConfigError, match="num_random=-1"):
        lnp.Sandwich(-1)


def test_constrained_keeps_only_architectures_in_range_and_names_an_empty_one() -> None:
    supernet = _space()
    sizes = sorted({subnet_parameters(supernet, {a: i, b: j}) for i in range(3) for j in range(3)
                    for a, b in [tuple(supernet.labels)]})
    sampler = lnp.Constrained(max_params=sizes[3], num_subnets=3)
    for step in range(20):
        chosen = sampler(supernet, 1, step)
        assert len(chosen) == 3 and all(sampler.params(supernet, a) <= sizes[3] for a in chosen)
    assert lnp.Constrained(min_params=sizes[-1], max_params=sizes[-1])(supernet, 1, 0) == [
        {name: 2 for name in supernet.labels}]
    with pytest.raises(lnp.NASPipeConfigError, match="no architecture of 50 uniform draws .* widen"):
        lnp.Constrained(max_params=sizes[0] - 1, max_attempts=50)(supernet, 1, 0)
    with pytest.raises(lnp.NASPipeConfigError, match="an empty range"):
        lnp.Constrained(min_params=10, max_params=5)


def test_constrained_refuses_a_range_of_its_constraints_the_space_cannot_meet_before_judging_any_draw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    supernet = _space()
    smallest = min(subnet_parameters(supernet, {a: i, b: j}) for i in range(3) for j in range(3)
                   for a, b in [tuple(supernet.labels)])
    judged: list[object] = []
    sampler = lnp.Constrained(constraints=lnp.Constraints(max_params=smallest - 1))
    real_params = sampler.params
    monkeypatch.setattr(sampler, "params", lambda *a: judged.append(a) or real_params(*a))
    with pytest.raises(lnp.NASPipeConfigError, match=f"max_params={smallest - 1:,}.*the smallest has {smallest:,}"):
        sampler(supernet, 1, 0)
    assert judged == []  # counted from the space, not from draws
    assert lnp.Constrained(constraints=lnp.Constraints(max_params=smallest))(supernet, 1, 0)  # the bound itself fits


class _Distilling:
    """The engine's view of a module training the sandwich rule with in-place distillation."""

    naspipe_seed = 3

    def __init__(self, supernet: lnp.Supernet) -> None:
        self.supernet = supernet
        self.optimizer = torch.optim.SGD(supernet.parameters(), lr=0.1)
        self.trainer = SimpleNamespace(lr_scheduler_configs=[], callback_metrics={})

    def sample_subnet(self, index: int) -> dict[str, int]:
        raise AssertionError("sample_step decides")

    def sample_step(self, step: int) -> list[dict[str, int]]:
        return lnp.Sandwich(0)(self.supernet, self.naspipe_seed, step)

    def pipeline_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, output: torch.Tensor, batch: Any, teacher: torch.Tensor | None = None) -> torch.Tensor:
        return distilled_loss(output, batch[1], teacher)

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizers(self) -> Any:
        return SimpleNamespace(optimizer=self.optimizer, step=self.optimizer.step)


def distilled_loss(output: torch.Tensor, target: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    loss = nn.functional.cross_entropy(output, target)
    if teacher is not None:
        loss = loss + nn.functional.mse_loss(output, teacher)
    return loss


def test_one_step_is_the_recipe_written_out_in_torch() -> None:
    """Largest, then smallest learning from the largest's detached output, gradients summed, one SGD step."""
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    engine_net, manual_net = _space(), _space()
    module = _Distilling(engine_net)
    window = Engine([range(len(engine_net))]).train_window(module, [(x, y)], 0)  # type: ignore[arg-type]
    largest, smallest = lnp.Sandwich(0)(manual_net, 3, 0)
    optimizer = torch.optim.SGD(manual_net.parameters(), lr=0.1)
    teacher = manual_net(x, largest)
    first = distilled_loss(teacher, y, None)
    first.backward()
    second = distilled_loss(manual_net(x, smallest), y, teacher.detach())
    second.backward()
    optimizer.step()
    for (name, a), b in zip(engine_net.named_parameters(), manual_net.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert window.losses[0] is not None and torch.allclose(window.losses[0], first.detach() + second.detach())
    assert [name for _, name, *_ in window.records] == ["train_loss_subnet0", "train_loss_subnet1"]
