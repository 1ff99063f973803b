from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp


def test_choice_block_accepts_list_and_dict() -> None:
    block = lnp.ChoiceBlock({"a": nn.Identity(), "b": nn.ReLU()}, label="x")
    assert len(block) == 2 and block.candidate_names == ["a", "b"] and block.label == "x"
    assert len(lnp.ChoiceBlock([nn.Identity()])) == 1


@pytest.mark.parametrize("candidates", [[], {}])
def test_empty_choice_block_is_refused(candidates: object) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="no candidates"):
        lnp.ChoiceBlock(candidates)  # type: ignore[arg-type]


def test_non_module_candidate_is_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="not an nn.Module"):
        lnp.ChoiceBlock([nn.Identity(), "relu"])  # type: ignore[list-item]


def test_labels_default_per_block_and_can_be_shared() -> None:
    net = lnp.Supernet(nn.Linear(2, 2), lnp.ChoiceBlock([nn.Identity(), nn.ReLU()]),
                       lnp.ChoiceBlock([nn.Tanh(), nn.ReLU(), nn.Identity()], label="s"),
                       lnp.ChoiceBlock([nn.Tanh(), nn.ReLU(), nn.Identity()], label="s"))
    assert net.labels == {"block1": 2, "s": 3}


def test_shared_label_needs_equal_candidate_counts() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="different candidate counts"):
        lnp.Supernet(lnp.ChoiceBlock([nn.Identity()], label="s"),
                     lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label="s"))


def test_empty_supernet_is_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="at least one block"):
        lnp.Supernet()


@pytest.mark.parametrize("architecture, needle", [
    ({"a": 0, "zzz": 1}, "unknown label"), ({}, "lacks a choice"), ({"a": 2}, "valid indices 0..1"),
    ({"a": -1}, "valid indices"), ({"a": True}, "valid indices"), ([0], "dict"),
])
def test_bad_architectures(architecture: object, needle: str) -> None:
    net = lnp.Supernet(lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label="a"))
    with pytest.raises(lnp.NASPipeConfigError, match=needle):
        net.validate(architecture)  # type: ignore[arg-type]


def test_resources_cover_stateful_modules_only() -> None:
    tied = nn.Linear(3, 3)
    net = lnp.Supernet(
        nn.Linear(3, 3),                                        # 0: trainable fixed block
        nn.ReLU(),                                              # 1: stateless fixed block
        lnp.ChoiceBlock([nn.Identity(), nn.BatchNorm1d(3), tied], label="c"),  # 2
        lnp.ChoiceBlock([nn.Identity(), nn.ReLU(), tied], label="c"),          # 3: tied reuses block 2's
    )
    everything = range(len(net))
    assert net.resources(everything, {"c": 0}) == {(0, -1)}
    assert net.resources(everything, {"c": 1}) == {(0, -1), (2, 1)}  # BatchNorm: buffers change in forward
    assert net.resources(everything, {"c": 2}) == {(0, -1), (2, 2)}  # one module, one resource
    assert net.resources(range(2, 4), {"c": 2}) == {(2, 2)}
    assert net.resource_state((2, 2)).params == tuple(tied.parameters())


def test_forward_runs_the_chosen_subnet() -> None:
    net = lnp.Supernet(lnp.ChoiceBlock({"neg": _Neg(), "id": nn.Identity()}, label="a"))
    x = torch.ones(2)
    assert torch.equal(net(x, {"a": 0}), -x)
    assert torch.equal(net(x, {"a": 1}), x)
    with pytest.raises(RuntimeError, match="none is active"):
        net.blocks[0](x)


class _Neg(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


def test_nested_choices_get_path_labels_and_only_chosen_leaves_are_resources() -> None:
    inner = lnp.ChoiceBlock([nn.Linear(3, 3), nn.Tanh()])
    layer = nn.Sequential(nn.LayerNorm(3), lnp.ChoiceBlock([nn.Linear(3, 3), inner], label="outer"))
    net = lnp.Supernet(nn.Linear(3, 3), layer)
    assert net.labels == {"outer": 2, "block1.1.candidates.1": 2}
    assert net.resources(range(2), {"outer": 0, "block1.1.candidates.1": 0}) == {(0, -1), (1, -1), (1, -1, 0, 0)}
    assert net.resources(range(2), {"outer": 1, "block1.1.candidates.1": 0}) == {(0, -1), (1, -1), (1, -1, 0, 1, 0, 0)}
    assert net.resources(range(2), {"outer": 1, "block1.1.candidates.1": 1}) == {(0, -1), (1, -1)}
    x = torch.ones(2, 3)
    arch = {"outer": 1, "block1.1.candidates.1": 1}
    assert torch.equal(net(x, arch), torch.tanh(layer[0](net.blocks[0](x))))


def test_what_cannot_work_is_refused_when_the_supernet_is_built() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="cannot nest another"):
        lnp.Supernet(nn.Sequential(lnp.Supernet(nn.Linear(2, 2))))
    with pytest.raises(lnp.NASPipeConfigError, match="When at .* depends on label 'nope'"):
        lnp.Supernet(lnp.ChoiceBlock([nn.Identity()], label="a"), nn.Sequential(lnp.When(nn.Linear(2, 2), "nope",
                                                                                        frozenset([0]))))
    with pytest.raises(lnp.NASPipeConfigError, match="different candidate counts"):
        lnp.Supernet(nn.Sequential(lnp.ChoiceBlock([nn.Identity()], label="s")),
                     lnp.ChoiceBlock([nn.Identity(), nn.ReLU()], label="s"))
