"""Elastic blocks: depth, attention heads and MLP width as choices over shared layers and weights.

:class:`ElasticDepth` runs the first ``d`` of its layers (once-for-all's elastic depth; layer ``i``
is a conditional scope used only by depths above ``i``, so it is a resource only of those subnets).
:class:`ElasticAttention` and :class:`ElasticMLP` are a transformer layer's halves with an elastic head
count and hidden width (AutoFormer, NASViT): ``h`` heads use the leading ``h * head_dim`` rows of the
query, key and value weights and the same columns of the output weight; hidden width ``r * embed_dim``
the leading rows of the first weight and columns of the second. A transformer block composes them::

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(64), nn.LayerNorm(64)
            self.attention = lnp.ElasticAttention(64, num_heads=[2, 4], head_dim=16)
            self.mlp = lnp.ElasticMLP(64, ratios=[2, 3, 4])

        def forward(self, x: Tensor) -> Tensor:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    encoder = lnp.ElasticDepth([Layer() for _ in range(4)], depths=[2, 3, 4])

An elastic embedding width (AutoFormer) is a list of widths for ``embed_dim`` with ``embed_label``, the label of
the layers producing it (see :mod:`.elastic_transformer`).

Frozen, they become ``nn.Sequential`` of the chosen layers, :class:`SelfAttention` and
``nn.Sequential(nn.Linear, activation, nn.Linear)`` holding copies of the slices the forward computes on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.choice import _ACTIVE, Elastic, When
from lightning_naspipe.space.elastic import plain_copy

__all__ = ["ElasticAttention", "ElasticDepth", "ElasticMLP", "SelfAttention", "attention"]


def _embed_dim(module: Elastic, embed_dim: int | Sequence[int], label: str | None) -> tuple[int, ...]:
    """Declare the input and output width: fixed, or elastic following ``label`` (the embedding width's)."""
    what = type(module).__name__
    if not isinstance(embed_dim, int) and label is None:
        raise NASPipeConfigError(
            f"{what}: an elastic embed_dim ({embed_dim!r}) follows the layer producing the embedding; pass "
            "embed_label=<that layer's width label>, or a whole number for a fixed width.")
    if isinstance(embed_dim, int) and label is not None:
        raise NASPipeConfigError(f"{what}(embed_dim={embed_dim!r}, embed_label={label!r}): a fixed embed_dim "
                                 "follows no label; give the candidate widths, e.g. embed_dim=[32, 64], or drop "
                                 "embed_label.")
    return module.add_dim("embed", embed_dim, label)


class ElasticDepth(Elastic):
    """A block of layers that runs its first ``d``, ``d`` one of ``depths``.

    Args:
        layers: the layers, applied in order (each takes the previous one's output).
        depths: the candidate depths, each between 0 and ``len(layers)`` (default ``1 .. len(layers)``).
        label: the depth's label (default ``"<path>.depth"``).
    """

    def __init__(self, layers: Sequence[nn.Module], depths: Sequence[int] | None = None,
                 label: str | None = None) -> None:
        super().__init__()
        if not isinstance(layers, Sequence) or not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise NASPipeConfigError("ElasticDepth(layers) takes a non-empty list of nn.Module layers.")
        if isinstance(depths, int) or (depths is not None and not isinstance(depths, Sequence)):
            raise NASPipeConfigError(f"ElasticDepth(depths={depths!r}): give a list of candidate depths, e.g. "
                                     "[2, 3, 4] (a fixed depth is an nn.Sequential).")
        self.depths = self.add_dim("depth", list(range(1, len(layers) + 1)) if depths is None else depths, label,
                                   minimum=0)
        if max(self.depths) > len(layers):
            raise NASPipeConfigError(f"ElasticDepth(depths={list(self.depths)}) has only {len(layers)} layers.")
        # Layer i runs for the choices whose depth exceeds i: a conditional scope, frozen away when unused.
        self.layers = nn.ModuleList([When(layer, label or "", frozenset(k for k, d in enumerate(self.depths) if d > i))
                                     for i, layer in enumerate(layers)])

    def set_label(self, name: str, label: str) -> None:
        """Give the depth its label, and the layers' conditions with it."""
        super().set_label(name, label)
        for layer in self.layers:
            cast(When, layer).label = label

    def forward(self, x: object) -> object:
        for layer in self.layers[:self.value("depth")]:
            x = cast(When, layer).body(x)
        return x

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.Sequential`` of the first ``d`` layers (frozen)."""
        return nn.Sequential(*list(self.layers)[:self.value_in("depth", architecture)])


def attention(x: Tensor, query: nn.Linear | tuple[Tensor, Tensor | None], key: nn.Linear | tuple[Tensor, Tensor | None],
              value: nn.Linear | tuple[Tensor, Tensor | None], out: nn.Linear | tuple[Tensor, Tensor | None],
              heads: int, causal: bool) -> Tensor:
    """Multi-head self-attention of ``x`` (``(..., tokens, features)``) with the given projections.

    Each projection is an ``nn.Linear`` or its ``(weight, bias)``; the elastic and the frozen module both
    compute through this function, so equal tensors give bitwise equal outputs.
    """
    def project(y: Tensor, linear: nn.Linear | tuple[Tensor, Tensor | None]) -> Tensor:
        weight, bias = (linear.weight, linear.bias) if isinstance(linear, nn.Linear) else linear
        return F.linear(y, weight, bias)

    tokens = x.shape[-2]

    def split(y: Tensor) -> Tensor:
        return y.reshape(*y.shape[:-1], heads, y.shape[-1] // heads).transpose(-3, -2)

    q, k, v = split(project(x, query)), split(project(x, key)), split(project(x, value))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    mixed = (scores.softmax(-1) @ v).transpose(-3, -2)
    return project(mixed.reshape(*mixed.shape[:-2], -1), out)


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``heads`` heads of ``head_dim`` features: a frozen :class:`ElasticAttention`.

    Args:
        embed_dim: the input and output features.
        heads: the number of heads.
        head_dim: the features per head.
        bias: whether the projections add a bias.
        causal: each token attends only to itself and earlier tokens.
        device: where to create the weights (as for ``nn.Linear``).
        dtype: their dtype (as for ``nn.Linear``).
    """

    def __init__(self, embed_dim: int, heads: int, head_dim: int, bias: bool = True, causal: bool = False,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, heads * head_dim, bias, **kwargs)
                                                 for _ in range(3))
        self.out_proj = nn.Linear(heads * head_dim, embed_dim, bias, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return attention(x, self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.heads, self.causal)


class ElasticAttention(Elastic):
    """Multi-head self-attention whose head count is a choice over shared projections.

    ``h`` heads use the leading ``h * head_dim`` output rows of the query, key and value projections and
    the same input columns of the output projection. Input ``(..., tokens, embed_dim)``. With an elastic
    ``embed_dim`` (AutoFormer's embedding width), width ``e`` uses the leading ``e`` input columns of the query,
    key and value projections and the leading ``e`` output rows of the output projection.

    Args:
        embed_dim: the input and output features: a fixed width, or the candidate widths (with ``embed_label``).
        num_heads: the candidate head counts (or a fixed count).
        head_dim: the features per head.
        bias: whether the projections add a bias.
        causal: each token attends only to itself and earlier tokens.
        label: the head count's label (default ``"<path>.heads"``).
        embed_label: the label an elastic ``embed_dim`` follows (the embedding width's).
    """

    def __init__(self, embed_dim: int | Sequence[int], num_heads: int | Sequence[int], head_dim: int,
                 bias: bool = True, causal: bool = False, label: str | None = None,
                 embed_label: str | None = None) -> None:
        super().__init__()
        self.head_counts = self.add_dim("heads", num_heads, label)
        if isinstance(embed_dim, bool) or (isinstance(embed_dim, int) and embed_dim < 1) or isinstance(
                head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise NASPipeConfigError(f"ElasticAttention(embed_dim={embed_dim!r}, head_dim={head_dim!r}): whole numbers "
                                     ">= 1 (embed_dim: or a list of candidate widths).")
        self.embed_sizes = _embed_dim(self, embed_dim, embed_label)
        self.embed_dim, self.head_dim, self.causal, self.has_bias = max(self.embed_sizes), head_dim, causal, bias
        inner = max(self.head_counts) * head_dim
        # the largest projections (nn.Linear's initialisation); the forward slices them by head count and width
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(self.embed_dim, inner, bias) for _ in range(3))
        self.out_proj = nn.Linear(inner, self.embed_dim, bias)

    def _slices(self, heads: int, embed: int | None = None) -> list[tuple[Tensor, Tensor | None]]:
        inner, embed = heads * self.head_dim, self.embed_dim if embed is None else embed
        inputs = (self.q_proj, self.k_proj, self.v_proj)
        projections = [p.weight[:inner, :embed].contiguous() for p in inputs]
        biases = [None if p.bias is None else p.bias[:inner].contiguous() for p in inputs]
        out_bias = None if self.out_proj.bias is None else self.out_proj.bias[:embed].contiguous()
        return [*zip(projections, biases), (self.out_proj.weight[:embed, :inner].contiguous(), out_bias)]

    def forward(self, x: Tensor) -> Tensor:
        heads, embed = self.value("heads", self.head_counts), self.value("embed", (self.embed_dim,))
        if x.shape[-1] != embed:
            raise RuntimeError(f"{self.where()} expects {embed} features, got {x.shape[-1]}.")
        try:
            query, key, value, out = self._slices(heads, embed)
            return attention(x, query, key, value, out, heads, self.causal)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """:class:`SelfAttention` with the chosen heads' projections."""
        heads = self.value_in("heads", architecture, self.head_counts)
        embed = self.value_in("embed", architecture, (self.embed_dim,))
        frozen = SelfAttention(embed, heads, self.head_dim, self.has_bias, self.causal, device="meta")
        for name, (weight, bias) in zip(("q_proj", "k_proj", "v_proj", "out_proj"), self._slices(heads, embed)):
            linear = plain_copy(nn.Linear, getattr(self, name), {"weight": weight, "bias": bias}, weight.shape[1],
                                weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
            setattr(frozen, name, linear)
        return frozen


class ElasticMLP(Elastic):
    """A transformer's MLP (``Linear``, activation, ``Linear``) whose hidden width is a choice over shared weights.

    With an elastic ``embed_dim`` (AutoFormer's embedding width), width ``e`` uses the leading ``e`` input
    columns of the first weight and output rows of the second, and ratio ``r`` the hidden width
    ``round(r * e)`` (AutoFormer's MLP ratio, of the chosen width; the ``"hidden"`` dimension lists the hidden
    widths at the largest ``e``).

    Args:
        embed_dim: the input and output features: a fixed width, or the candidate widths (with ``embed_label``).
        ratios: the candidate hidden widths as multiples of ``embed_dim`` (hidden ``round(r * embed_dim)``).
        bias: whether the layers add a bias.
        activation: the activation module (default ``nn.GELU()``).
        label: the hidden width's label (default ``"<path>.hidden"``).
        embed_label: the label an elastic ``embed_dim`` follows (the embedding width's).
    """

    def __init__(self, embed_dim: int | Sequence[int], ratios: Sequence[float], bias: bool = True,
                 activation: nn.Module | None = None, label: str | None = None,
                 embed_label: str | None = None) -> None:
        super().__init__()
        if not isinstance(ratios, Sequence) or not ratios or any(
                isinstance(r, bool) or not isinstance(r, (int, float)) or r <= 0 for r in ratios):
            raise NASPipeConfigError(f"ElasticMLP(ratios={ratios!r}): a non-empty list of positive numbers, e.g. "
                                     "[2, 3, 4].")
        if isinstance(embed_dim, bool) or (isinstance(embed_dim, int) and embed_dim < 1):
            raise NASPipeConfigError(f"ElasticMLP(embed_dim={embed_dim!r}): a whole number >= 1.")
        self.embed_sizes = _embed_dim(self, embed_dim, embed_label)
        self.embed_dim, self.ratios = max(self.embed_sizes), tuple(ratios)
        self.hidden_sizes = self.add_dim("hidden", [self._hidden(r, self.embed_dim) for r in ratios], label)
        self.fc1 = nn.Linear(self.embed_dim, max(self.hidden_sizes), bias)
        self.activation = activation if activation is not None else nn.GELU()
        self.fc2 = nn.Linear(max(self.hidden_sizes), self.embed_dim, bias)

    @staticmethod
    def _hidden(ratio: float, embed: int) -> int:
        return max(1, round(ratio * embed))

    def _sizes(self, architecture: Mapping[str, int] | None) -> tuple[int, int]:
        """The embedding and hidden widths, of the active subnet (``None``) or of ``architecture``."""
        if architecture is None:  # value() refuses to run without an active architecture
            embed, hidden = self.value("embed", (self.embed_dim,)), self.value("hidden", self.hidden_sizes)
        else:
            embed = self.value_in("embed", architecture, (self.embed_dim,))
            hidden = self.value_in("hidden", architecture, self.hidden_sizes)
        if embed != self.embed_dim:  # the ratio scales the chosen width, as AutoFormer's does
            chosen = architecture if architecture is not None else _ACTIVE.get()
            assert chosen is not None and self.dims["hidden"].label is not None
            hidden = self._hidden(self.ratios[chosen[self.dims["hidden"].label]], embed)
        return embed, hidden

    def _slices(self, hidden: int, embed: int | None = None) -> tuple[tuple[Tensor, Tensor | None],
                                                                      tuple[Tensor, Tensor | None]]:
        embed = self.embed_dim if embed is None else embed
        bias = None if self.fc1.bias is None else self.fc1.bias[:hidden].contiguous()
        first = (self.fc1.weight[:hidden, :embed].contiguous(), bias)
        out_bias = None if self.fc2.bias is None else self.fc2.bias[:embed].contiguous()
        return first, (self.fc2.weight[:embed, :hidden].contiguous(), out_bias)

    def forward(self, x: Tensor) -> Tensor:
        embed, hidden = self._sizes(None)
        if x.shape[-1] != embed:
            raise RuntimeError(f"{self.where()} expects {embed} features, got {x.shape[-1]}.")
        try:
            (w1, b1), (w2, b2) = self._slices(hidden, embed)
            return F.linear(self.activation(F.linear(x, w1, b1)), w2, b2)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.Sequential(nn.Linear, activation, nn.Linear)`` with the chosen hidden width."""
        embed, hidden = self._sizes(architecture)
        (w1, b1), (w2, b2) = self._slices(hidden, embed)
        return nn.Sequential(
            plain_copy(nn.Linear, self.fc1, {"weight": w1, "bias": b1}, embed, hidden, bias=b1 is not None,
                       device=w1.device, dtype=w1.dtype),
            self.activation,
            plain_copy(nn.Linear, self.fc2, {"weight": w2, "bias": b2}, hidden, embed, bias=b2 is not None,
                       device=w2.device, dtype=w2.dtype))
