"""An AutoFormer-style space from built-ins only (space/elastic_transformer.py, embed_label on ElasticAttention and
ElasticMLP): one elastic embedding width shared by the patch projection, position embedding, every LayerNorm,
attention, MLP and the head; per-layer heads and MLP ratio; ElasticDepth over the last layers. Frozen bitwise,
trained bitwise on 2 stages and on 2 stages x 2 replicas in process (tests/inprocess_grid.py), covered by latency
tables."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from inprocess_grid import assert_grid_equals, train_grid
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from helpers import fake_latency_timing
from lightning_naspipe.space.choice import active_architecture
from lightning_naspipe.space.elastic_blocks import SelfAttention
from lightning_naspipe.space.elastic_transformer import PatchEmbed
from test_engine import FakeModule

DIMS, CHANNELS, SIDE, PATCH, CLASSES = [4, 6, 8], 2, 4, 2, 3
TOKENS = (SIDE // PATCH) ** 2
SEED = 7


class Stem(nn.Module):
    """Patches plus a learned position embedding, both at the shared embedding width."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = lnp.ElasticPatchEmbed(CHANNELS, DIMS, PATCH, label="embed")
        self.position = lnp.ElasticEmbedding(TOKENS, DIMS, label="embed")

    def forward(self, x: Tensor) -> Tensor:
        return self.patches(x) + self.position(torch.arange(TOKENS))


class Layer(nn.Module):
    """A pre-norm transformer layer: per-layer heads and MLP ratio, the embedding width the stem's."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = lnp.ElasticLayerNorm(DIMS, label="embed")
        self.attention = lnp.ElasticAttention(DIMS, [1, 2], head_dim=2, embed_label="embed")
        self.norm2 = lnp.ElasticLayerNorm(DIMS, label="embed")
        self.mlp = lnp.ElasticMLP(DIMS, [1.5, 2], embed_label="embed")

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = lnp.ElasticLayerNorm(DIMS, label="embed")
        self.fc = lnp.ElasticLinear(DIMS, CLASSES, in_label="embed")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(x).mean(-2))


def autoformer() -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(Stem(), Layer(), lnp.ElasticDepth([Layer(), Layer()], depths=[0, 1, 2], label="depth"),
                        Head())


def images(count: int, batch: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, CHANNELS, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(count)]


def sample(supernet: lnp.Supernet, count: int) -> list[dict[str, int]]:
    return [uniform_architecture(supernet.labels, SEED, i) for i in range(count)]


def test_the_space_has_one_embedding_width_and_per_layer_heads_and_ratios() -> None:
    labels = autoformer().labels
    assert labels["embed"] == 3 and labels["depth"] == 3
    assert sum(label.endswith(".heads") for label in labels) == 3 and sum(label.endswith(".hidden") for label in
                                                                          labels) == 3


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_every_width_exports_to_plain_modules_bitwise(training: bool) -> None:
    supernet = autoformer().train(training)
    x = images(1)[0][0]
    for arch in sample(supernet, 10) + [{label: n - 1 for label, n in supernet.labels.items()}]:
        frozen = supernet.freeze(arch)
        assert not any(isinstance(m, lnp.Elastic) for m in frozen.modules())
        assert torch.equal(supernet(x, arch), frozen(x)), arch
        embed = DIMS[arch["embed"]]
        assert isinstance(frozen[0].patches, PatchEmbed) and frozen[0].patches.proj.out_channels == embed
        assert isinstance(frozen[0].position, nn.Embedding) and frozen[0].position.embedding_dim == embed
        assert isinstance(frozen[1].norm1, nn.LayerNorm) and frozen[1].norm1.normalized_shape == (embed,)
        assert isinstance(frozen[1].attention, SelfAttention) and frozen[1].attention.q_proj.in_features == embed
        ratio = [1.5, 2][arch["block1.mlp.hidden"]]
        assert frozen[1].mlp[0].weight.shape == (round(ratio * embed), embed)  # AutoFormer: ratio x chosen width
        assert frozen[3].fc.in_features == embed and len(frozen[2]) == arch["depth"]


def test_the_exported_subnet_saves_and_loads_bitwise(tmp_path: Any) -> None:
    supernet = autoformer().eval()
    x, arch = images(1)[0][0], sample(supernet, 1)[0] | {"embed": 1}
    folder = lnp.save_subnet(supernet.freeze(arch), tmp_path / "subnet", x)
    assert torch.equal(lnp.load_subnet(folder)(x), supernet(x, arch))


def test_the_layers_read_the_leading_slices_of_their_weights() -> None:
    torch.manual_seed(1)
    norm, table = lnp.ElasticLayerNorm([3, 5], label="e"), lnp.ElasticEmbedding(7, [3, 5], label="e")
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    x, tokens = torch.randn(2, 3), torch.tensor([[0, 6, 2]])
    with active_architecture({"e": 0}):
        assert torch.equal(norm(x), nn.functional.layer_norm(x, (3,), norm.weight[:3], norm.bias[:3]))
        assert torch.equal(table(tokens), table.weight[:, :3][tokens])
    attention = lnp.ElasticAttention([4, 8], 2, head_dim=2, embed_label="e")
    mlp = lnp.ElasticMLP([4, 8], [2], embed_label="e")
    supernet = lnp.Supernet(nn.Sequential(attention, mlp))
    frozen = supernet.freeze({"e": 0, "block0.1.hidden": 0})
    assert torch.equal(frozen[0][0].out_proj.weight, attention.out_proj.weight[:4])
    assert torch.equal(frozen[0][1][0].weight, mlp.fc1.weight[:8, :4]) and frozen[0][1][2].bias.shape == (4,)


def test_a_latency_table_keys_and_predicts_the_embedding_width(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_latency_timing(monkeypatch, lambda module: 1.0 + sum(p.numel() for p in module.parameters()) / 1000)
    supernet = autoformer()
    table = lnp.LatencyTable.measure(supernet, images(1)[0][0], repeats=1)
    assert [label for label, _ in table.nested[0]] == ["embed"]
    assert {label for label, _ in table.nested[1]} == {"embed", "block1.attention.heads", "block1.mlp.hidden"}
    for block in (0, 1, 3):
        # A wider embedding costs more everywhere; the shared width is timed around its middle choice.
        deltas = dict(table.nested[block])["embed"]
        assert deltas[0] < deltas[1] == 0.0 < deltas[2], block
    narrow = {label: 0 for label in supernet.labels}  # the other labels' reference: their deltas there are 0
    base = sum(row[0] for row in table.entries)

    def embed(k: int, blocks: tuple[int, ...]) -> float:
        return sum(dict(table.nested[block])["embed"][k] for block in blocks)

    for k in range(3):
        # At depth 0 the ElasticDepth (block 2) runs no layer, so reads no embedding width and adds no delta of it.
        assert table.predict(narrow | {"embed": k}, supernet) == pytest.approx(base + embed(k, (0, 1, 3)))
        assert table.predict(narrow | {"depth": 1, "embed": k}, supernet) == pytest.approx(
            base + dict(table.nested[2])["depth"][1] + embed(k, (0, 1, 2, 3)))


def _module(supernet: lnp.Supernet) -> FakeModule:
    module = FakeModule(supernet)
    module.optimizer = torch.optim.Adam(supernet.parameters(), lr=0.05)
    return module


@pytest.mark.parametrize(("replicas", "chunks"), [(1, 1), (2, 2)], ids=["2 stages", "2 stages x 2 replicas"])
def test_it_trains_bitwise_on_stages_and_replicas(replicas: int, chunks: int) -> None:
    batches, window, stage_blocks = images(6), 3, [range(0, 2), range(2, 4)]
    reference = _module(autoformer())
    engine = Engine([range(len(reference.supernet))], chunks=chunks)
    losses = [loss for start in range(0, len(batches), window)
              for loss in engine.train_window(reference, batches[start:start + window], start).losses]
    assert len({tuple(uniform_architecture(reference.supernet.labels, FakeModule.naspipe_seed, i).values())
                for i in range(len(batches))}) > 1
    grid = [[_module(autoformer()) for _ in range(replicas)] for _ in stage_blocks]
    found = train_grid(grid, stage_blocks, batches, window, chunks)
    expected = reference.supernet.state_dict()
    assert not torch.equal(expected["blocks.0.patches.proj.weight"], autoformer().state_dict()[
        "blocks.0.patches.proj.weight"]), "it trained"
    assert_grid_equals(losses, expected, found, grid, stage_blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize("make, match", [
    (lambda: lnp.ElasticAttention([4, 8], 2, head_dim=2), "pass embed_label="),
    (lambda: lnp.ElasticMLP([4, 8], [2]), "pass embed_label="),
    (lambda: lnp.ElasticMLP(8, [2], embed_label="e"), "a fixed embed_dim follows no label"),
    (lambda: lnp.ElasticAttention(0, 2, head_dim=2), "whole numbers >= 1"),
    (lambda: lnp.ElasticEmbedding(0, [4, 8]), "num_embeddings=0"),
    (lambda: lnp.ElasticEmbedding(5, [4, 8], padding_idx=5), "padding_idx=5"),
    (lambda: lnp.ElasticPatchEmbed(3, [4, 8], patch_size=0), "patch_size=0"),
    (lambda: lnp.ElasticLayerNorm(8, label="e"), "fixed size"),
])
def test_invalid_arguments_are_refused(make: Any, match: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=re.escape(match)):
        make()


def test_inputs_of_the_wrong_width_or_shape_name_the_layer_and_the_fix() -> None:
    supernet = autoformer()
    arch = {label: 0 for label in supernet.labels}
    with active_architecture(arch), pytest.raises(RuntimeError, match=re.escape(
            "ElasticLayerNorm at supernet.blocks.1.norm1 (width 4 of (4, 6, 8), label 'embed') expects 4 features in "
            "the last dimension, got 8.")):
        supernet.blocks[1].norm1(torch.randn(2, 8))
    with active_architecture(arch), pytest.raises(RuntimeError, match="H and W multiples of 2, got"):
        supernet.blocks[0].patches(torch.randn(1, CHANNELS, 3, 4))
    with active_architecture(arch), pytest.raises(IndexError, match="ElasticEmbedding at supernet.blocks.0.position"):
        supernet.blocks[0].position(torch.tensor([TOKENS]))


def test_every_embedding_width_and_ratio_of_one_mlp_freezes_bitwise() -> None:
    supernet = lnp.Supernet(lnp.ElasticMLP([3, 5, 8], [0.5, 1.5], embed_label="e", label="r"))
    for e, r in itertools.product(range(3), range(2)):
        x = torch.randn(2, [3, 5, 8][e])
        assert torch.equal(supernet(x, {"e": e, "r": r}), supernet.freeze({"e": e, "r": r})(x))
