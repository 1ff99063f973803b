"""Two spaces the latency table was not written against, for ``latency_error.py`` and ``tests/test_latency_spaces.py``
(issue 43, "predictions that hold"): each function builds the supernet and one input batch, at the benchmark's size
by default and smaller when a test asks.

- ``autoformer``: an AutoFormer-style vision transformer from built-ins only: one elastic embedding width shared by
  the patch projection, the position embedding, every LayerNorm, attention, MLP and the head; per-layer head count
  and MLP ratio; the last two layers under ``ElasticDepth`` (0, 1 or 2 of them).
- ``ofa``: a once-for-all-style MobileNet: a fixed stem, then units of inverted bottlenecks, each unit an
  ``ElasticDepth`` (its per-layer labels sit inside it), each layer with an elastic expansion width, an elastic
  depthwise kernel and a squeeze-excite of the user's own (:class:`ElasticSqueezeExcite`, an ``lnp.Elastic``
  subclass written as docs/guide.md tells users to) whose squeeze width is a label; a fixed head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

import lightning_naspipe as lnp

SPACES = ("autoformer", "ofa")


# -- autoformer ---------------------------------------------------------------------------------------------------


class _Stem(nn.Module):
    """Patches plus a learned position embedding, both at the shared embedding width ``"embed"``."""

    def __init__(self, channels: int, dims: Sequence[int], patch: int, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.patches = lnp.ElasticPatchEmbed(channels, list(dims), patch, label="embed")
        self.position = lnp.ElasticEmbedding(tokens, list(dims), label="embed")

    def forward(self, x: Tensor) -> Tensor:
        return self.patches(x) + self.position(torch.arange(self.tokens, device=x.device))


class _Layer(nn.Module):
    """A pre-norm transformer layer: its own head count and MLP ratio, the stem's embedding width."""

    def __init__(self, dims: Sequence[int], heads: Sequence[int], head_dim: int, ratios: Sequence[float]) -> None:
        super().__init__()
        self.norm1 = lnp.ElasticLayerNorm(list(dims), label="embed")
        self.attention = lnp.ElasticAttention(list(dims), list(heads), head_dim=head_dim, embed_label="embed")
        self.norm2 = lnp.ElasticLayerNorm(list(dims), label="embed")
        self.mlp = lnp.ElasticMLP(list(dims), list(ratios), embed_label="embed")

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Head(nn.Module):
    def __init__(self, dims: Sequence[int], classes: int) -> None:
        super().__init__()
        self.norm = lnp.ElasticLayerNorm(list(dims), label="embed")
        self.fc = lnp.ElasticLinear(list(dims), classes, in_label="embed")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(x).mean(-2))


def autoformer(dims: Sequence[int] = (64, 96, 128), heads: Sequence[int] = (2, 3, 4), head_dim: int = 16,
               ratios: Sequence[float] = (2.0, 3.0, 4.0), layers: int = 4, side: int = 32, patch: int = 4,
               batch: int = 8, classes: int = 10) -> tuple[lnp.Supernet, Tensor]:
    """The AutoFormer-style supernet (``layers - 2`` fixed layers, then 2 under ``ElasticDepth`` with depths 0, 1,
    2, label ``"depth"``) and a batch of ``batch`` random ``3 x side x side`` images; the same for a given size.

    Labels: ``"embed"``, ``"depth"`` and per layer ``"block<i>.attention.heads"`` and ``"block<i>.mlp.hidden"``
    (``"block<i>.layers.<j>.body..."`` inside the depth).
    """
    torch.manual_seed(0)
    tokens = (side // patch) ** 2
    supernet = lnp.Supernet(
        _Stem(3, dims, patch, tokens),
        *(_Layer(dims, heads, head_dim, ratios) for _ in range(layers - 2)),
        lnp.ElasticDepth([_Layer(dims, heads, head_dim, ratios) for _ in range(2)], depths=[0, 1, 2], label="depth"),
        _Head(dims, classes))
    return supernet.eval(), torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


# -- ofa ----------------------------------------------------------------------------------------------------------


class SqueezeExcite(nn.Module):
    """Squeeze-excite as a plain module: pool, 1x1 down to ``squeeze`` channels, ReLU, 1x1 up, sigmoid gate."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.down = nn.Conv2d(channels, squeeze, 1)
        self.up = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.up(torch.relu(self.down(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(gate)


class ElasticSqueezeExcite(lnp.Elastic):
    """A user's elastic module (docs/guide.md, "An elastic module of your own"): squeeze-excite whose channels
    follow the layer before it (``in_label``) and whose squeeze width is a choice of its own (``label``), both the
    leading slices of one pair of weights.

    Args:
        channels: the candidate channel counts (those of the layer before, with ``in_label``).
        squeeze: the candidate squeeze widths.
        label: the squeeze width's label (default ``"<path>.squeeze"``).
        in_label: the label the channels follow.
    """

    def __init__(self, channels: Sequence[int], squeeze: Sequence[int], label: str | None = None,
                 in_label: str | None = None) -> None:
        super().__init__()
        self.channels = self.add_dim("in", list(channels), in_label)
        self.squeeze = self.add_dim("squeeze", list(squeeze), label)
        full = SqueezeExcite(max(self.channels), max(self.squeeze))
        self.down_weight = nn.Parameter(full.down.weight.detach()[:, :, 0, 0].clone())
        self.down_bias = nn.Parameter(full.down.bias.detach().clone())
        self.up_weight = nn.Parameter(full.up.weight.detach()[:, :, 0, 0].clone())
        self.up_bias = nn.Parameter(full.up.bias.detach().clone())

    def _slices(self, channels: int, squeeze: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return (self.down_weight[:squeeze, :channels].contiguous(), self.down_bias[:squeeze].contiguous(),
                self.up_weight[:channels, :squeeze].contiguous(), self.up_bias[:channels].contiguous())

    def forward(self, x: Tensor) -> Tensor:
        channels, squeeze = self.value("in", self.channels), self.value("squeeze", self.squeeze)
        if x.shape[1] != channels:
            raise RuntimeError(f"{self.where()} expects {channels} channels, got {x.shape[1]}")
        down_w, down_b, up_w, up_b = self._slices(channels, squeeze)
        try:
            hidden = torch.relu(nn.functional.conv2d(x.mean((2, 3), keepdim=True), down_w[:, :, None, None], down_b))
            return x * torch.sigmoid(nn.functional.conv2d(hidden, up_w[:, :, None, None], up_b))
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """The plain :class:`SqueezeExcite` of the chosen widths, holding copies of the slices."""
        channels = self.value_in("in", architecture, self.channels)
        squeeze = self.value_in("squeeze", architecture, self.squeeze)
        plain = SqueezeExcite(channels, squeeze).to(self.down_weight.device)
        down_w, down_b, up_w, up_b = self._slices(channels, squeeze)
        with torch.no_grad():
            plain.down.weight.copy_(down_w[:, :, None, None])
            plain.down.bias.copy_(down_b)
            plain.up.weight.copy_(up_w[:, :, None, None])
            plain.up.bias.copy_(up_b)
        return plain


class _Bottleneck(nn.Module):
    """Inverted bottleneck: 1x1 expansion (elastic width), depthwise kxk (elastic kernel), the user's
    squeeze-excite, 1x1 projection; residual when it keeps the shape."""

    def __init__(self, cin: int, cout: int, stride: int, name: str, expansions: Sequence[int],
                 kernels: Sequence[int], squeeze: Sequence[int]) -> None:
        super().__init__()
        widths = [cin * e for e in expansions]
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            lnp.ElasticConv2d(cin, widths, 1, bias=False, label=f"{name}.expand"),
            lnp.ElasticBatchNorm2d(widths, label=f"{name}.expand"), nn.ReLU(),
            lnp.ElasticConv2d(widths, widths, list(kernels), stride, bias=False, depthwise=True,
                              in_label=f"{name}.expand", kernel_label=f"{name}.kernel"),
            lnp.ElasticBatchNorm2d(widths, label=f"{name}.expand"), nn.ReLU(),
            ElasticSqueezeExcite(widths, squeeze, label=f"{name}.squeeze", in_label=f"{name}.expand"),
            lnp.ElasticConv2d(widths, cout, 1, bias=False, in_label=f"{name}.expand"),
            nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x) if self.residual else self.body(x)


def ofa(stem: int = 16, units: Sequence[int] = (24, 32), layers: int = 3, expansions: Sequence[int] = (3, 4, 6),
        kernels: Sequence[int] = (3, 5, 7), squeeze: Sequence[int] = (8, 16), side: int = 32, batch: int = 16,
        classes: int = 10) -> tuple[lnp.Supernet, Tensor]:
    """The OFA-style supernet (a stride-2 stem, one ``ElasticDepth`` unit per entry of ``units``, its first layer
    at stride 2, depths 1 to ``layers``, label ``"depth<u>"``; a fixed head) and a batch of ``batch`` random
    ``3 x side x side`` images; the same for a given size.

    Labels: ``"depth<u>"`` and per layer ``"u<u>l<i>.expand"``, ``".kernel"`` and ``".squeeze"`` (the user's
    module), all but the unit's depth inside its ``ElasticDepth``.
    """
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem),
                                             nn.ReLU())]
    cin = stem
    for u, cout in enumerate(units):
        blocks.append(lnp.ElasticDepth(
            [_Bottleneck(cin if i == 0 else cout, cout, 2 if i == 0 else 1, f"u{u}l{i}", expansions, kernels, squeeze)
             for i in range(layers)], depths=list(range(1, layers + 1)), label=f"depth{u}"))
        cin = cout
    blocks.append(nn.Sequential(nn.Conv2d(cin, 4 * cin, 1, bias=False), nn.BatchNorm2d(4 * cin), nn.ReLU(),
                                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * cin, classes)))
    supernet = lnp.Supernet(*blocks)
    return supernet.eval(), torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


def latency_space(name: str) -> tuple[lnp.Supernet, Tensor]:
    """``autoformer`` or ``ofa`` at the benchmark's size."""
    return {"autoformer": autoformer, "ofa": ofa}[name]()
