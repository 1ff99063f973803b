"""Elastic blocks (space/elastic_blocks.py): depth, attention heads and MLP width; frozen bitwise and smaller."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from lightning_naspipe.space.choice import active_architecture
from lightning_naspipe.space.elastic_blocks import SelfAttention

EMBED = 8


class Layer(nn.Module):
    """A pre-norm transformer layer with elastic heads and MLP width (labels assigned by the supernet)."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attention = lnp.ElasticAttention(EMBED, [1, 2, 4], head_dim=2, causal=causal)
        self.mlp = lnp.ElasticMLP(EMBED, [1, 2, 3])

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Record(nn.Module):
    """Appends its index to a shared list when run (to see which layers of a depth block ran)."""

    def __init__(self, index: int, ran: list[int]) -> None:
        super().__init__()
        self.index, self.ran = index, ran
        self.scale = nn.Parameter(torch.tensor(float(index + 1)))

    def forward(self, x: Tensor) -> Tensor:
        self.ran.append(self.index)
        return x * self.scale


def transformer(causal: bool = False) -> lnp.Supernet:
    return lnp.Supernet(nn.Linear(3, EMBED), lnp.ElasticDepth([Layer(causal) for _ in range(3)], [1, 2, 3],
                                                              label="depth"), nn.Linear(EMBED, 2))


def sample(supernet: lnp.Supernet, count: int, seed: int = 0) -> list[dict[str, int]]:
    generator = torch.Generator().manual_seed(seed)
    return [{label: int(torch.randint(n, (), generator=generator)) for label, n in supernet.labels.items()}
            for _ in range(count)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_frozen_transformer_is_smaller_and_bitwise_equal(causal: bool, training: bool) -> None:
    torch.manual_seed(0)
    supernet = transformer(causal).train(training)
    x = torch.randn(2, 5, 3)
    everything = sum(p.numel() for p in supernet.parameters())
    for arch in sample(supernet, 12):
        frozen = supernet.freeze(arch)
        assert not any(isinstance(m, lnp.Elastic) for m in frozen.modules())
        assert len(frozen[1]) == arch["depth"] + 1
        assert torch.equal(supernet(x, arch), frozen(x)), arch
        assert sum(p.numel() for p in frozen.parameters()) < everything
    largest = supernet.freeze({label: n - 1 for label, n in supernet.labels.items()})
    assert sum(p.numel() for p in largest.parameters()) == everything


def test_frozen_attention_and_mlp_are_plain_modules_of_the_chosen_size() -> None:
    supernet = transformer()
    arch = {label: 0 for label in supernet.labels}
    arch |= {"depth": 0, "block1.layers.0.body.attention.heads": 1, "block1.layers.0.body.mlp.hidden": 2}
    layer = supernet.freeze(arch)[1][0]
    assert isinstance(layer.attention, SelfAttention) and layer.attention.heads == 2
    assert layer.attention.q_proj.weight.shape == (4, EMBED) and layer.attention.out_proj.weight.shape == (EMBED, 4)
    assert [type(m) for m in layer.mlp] == [nn.Linear, nn.GELU, nn.Linear] and layer.mlp[0].out_features == 24


def test_depth_runs_its_first_d_layers_and_unused_layers_are_no_resource() -> None:
    ran: list[int] = []
    depth = lnp.ElasticDepth([Record(i, ran) for i in range(4)], depths=[0, 2, 4])
    supernet = lnp.Supernet(depth)
    assert supernet.labels == {"block0.depth": 3}
    x = torch.ones(2)
    for choice, d in enumerate([0, 2, 4]):
        ran.clear()
        out = supernet(x, {"block0.depth": choice})
        assert ran == list(range(d))
        assert torch.equal(out, torch.full((2,), float(torch.arange(1, d + 1).prod())))
        used = supernet.resources([0], {"block0.depth": choice})
        assert {p for key in used for p in supernet.resource_state(key).params} == {
            depth.layers[i].body.scale for i in range(d)}
        frozen = supernet.freeze({"block0.depth": choice})
        assert len(frozen[0]) == d and sum(p.numel() for p in frozen.parameters()) == d


def test_labels_inside_layers_a_depth_skips_are_unreachable() -> None:
    supernet = transformer()
    arch = {label: 1 for label in supernet.labels} | {"depth": 0}
    reached = supernet.reachable_labels(arch)
    assert "block1.layers.0.body.mlp.hidden" in reached and "block1.layers.1.body.mlp.hidden" not in reached
    assert supernet.canonical(arch)["block1.layers.2.body.attention.heads"] == 0


def test_heads_use_the_leading_rows_of_the_projections() -> None:
    torch.manual_seed(1)
    attention = lnp.ElasticAttention(EMBED, [1, 2], head_dim=4, label="h")
    plain = SelfAttention(EMBED, 1, 4)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(plain, name).weight.copy_(getattr(attention, name).weight[:4])
            getattr(plain, name).bias.copy_(getattr(attention, name).bias[:4])
        plain.out_proj.weight.copy_(attention.out_proj.weight[:, :4])
        plain.out_proj.bias.copy_(attention.out_proj.bias)
    x = torch.randn(3, 6, EMBED)
    with active_architecture({"h": 0}):
        assert torch.equal(attention(x), plain(x))
    reference = nn.MultiheadAttention(EMBED, 2, batch_first=True)  # the largest choice is standard attention
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([getattr(attention, n).weight for n in ("q_proj", "k_proj",
                                                                                          "v_proj")]))
        reference.in_proj_bias.copy_(torch.cat([getattr(attention, n).bias for n in ("q_proj", "k_proj", "v_proj")]))
        reference.out_proj.weight.copy_(attention.out_proj.weight)
        reference.out_proj.bias.copy_(attention.out_proj.bias)
    with active_architecture({"h": 1}):
        assert torch.allclose(attention(x), reference(x, x, x, need_weights=False)[0], atol=1e-5)


def test_transformer_trains_through_every_choice_and_saves(tmp_path: Any) -> None:
    torch.manual_seed(2)
    supernet = transformer()
    optimizer = torch.optim.SGD(supernet.parameters(), lr=0.1)
    x = torch.randn(4, 5, 3)
    for arch in sample(supernet, 4, seed=3):
        optimizer.zero_grad()
        supernet(x, arch).square().mean().backward()
        optimizer.step()
    arch = sample(supernet, 1, seed=4)[0]
    folder = lnp.save_subnet(supernet.freeze(arch), tmp_path / "subnet", x)
    assert torch.equal(lnp.load_subnet(folder)(x), supernet.eval()(x, arch))


@pytest.mark.parametrize("make, match", [
    (lambda: lnp.ElasticDepth([]), "non-empty"),
    (lambda: lnp.ElasticDepth([nn.Identity()], depths=2), "list of candidate depths"),
    (lambda: lnp.ElasticDepth([nn.Identity()], depths=[1, 2]), "only 1 layers"),
    (lambda: lnp.ElasticMLP(4, []), "non-empty"),
    (lambda: lnp.ElasticAttention(4, [1, 2], head_dim=0), "whole numbers"),
])
def test_invalid_arguments_are_refused(make: Any, match: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=match):
        make()


def test_every_architecture_of_a_small_space_freezes() -> None:
    supernet = lnp.Supernet(lnp.ElasticDepth([lnp.ElasticMLP(4, [1, 2], label="r") for _ in range(2)], label="d"))
    x = torch.randn(3, 4)
    for values in itertools.product(range(2), range(2)):
        arch = dict(zip(["d", "r"], values))
        assert torch.equal(supernet(x, arch), supernet.freeze(arch)(x))


def test_attention_and_mlp_of_the_wrong_width_name_their_path_labels_and_active_sizes() -> None:
    space = lnp.Supernet(Layer())
    architecture = {"block0.attention.heads": 2, "block0.mlp.hidden": 1}
    with active_architecture(architecture), pytest.raises(RuntimeError, match=re.escape(
            "ElasticAttention at supernet.blocks.0.attention (heads 4 of (1, 2, 4), label 'block0.attention.heads') "
            "expects 8 features, got 6.")):
        space.blocks[0].attention(torch.randn(2, 3, 6))
    with active_architecture(architecture), pytest.raises(RuntimeError, match=re.escape(
            "ElasticMLP at supernet.blocks.0.mlp (hidden 16 of (8, 16, 24), label 'block0.mlp.hidden') expects 8 "
            "features, got 6.")):
        space.blocks[0].mlp(torch.randn(2, 3, 6))
