"""Elastic embedding width: LayerNorm, token embedding and patch projection over the leading features of one weight.

AutoFormer's embedding width is one choice every layer follows: the patch projection (or token embedding)
produces the leading ``e`` features, and each LayerNorm, attention and MLP reads them. Give all of them one
label; :class:`~lightning_naspipe.space.elastic_blocks.ElasticAttention` and
:class:`~lightning_naspipe.space.elastic_blocks.ElasticMLP` follow it with ``embed_label``::

    dims = [32, 48, 64]
    patches = lnp.ElasticPatchEmbed(3, dims, patch_size=4, label="embed")   # (B, 3, H, W) -> (B, tokens, e)
    norm = lnp.ElasticLayerNorm(dims, label="embed")
    attention = lnp.ElasticAttention(dims, [2, 4], head_dim=16, embed_label="embed")
    head = lnp.ElasticLinear(dims, 10, in_label="embed")

Frozen, they are ``nn.LayerNorm(e)``, ``nn.Embedding(n, e)`` and :class:`PatchEmbed` holding contiguous copies
of the slices the forward computes on, so the two give bitwise equal outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.choice import Elastic
from lightning_naspipe.space.elastic import Sizes, plain_copy

__all__ = ["ElasticEmbedding", "ElasticLayerNorm", "ElasticPatchEmbed", "PatchEmbed"]


def _lead(t: Tensor | None, count: int, dim: int = 0) -> Tensor | None:
    """The leading ``count`` entries along ``dim``, contiguous: the tensor the frozen module holds."""
    return None if t is None else t.narrow(dim, 0, count).contiguous()


class ElasticLayerNorm(Elastic):
    """``nn.LayerNorm`` over the last dimension whose width is a choice: width ``d`` normalises the input's ``d``
    features with the leading ``d`` entries of the weight and bias.

    Args:
        normalized_shape: a fixed width, or the candidate widths (give ``label`` of the layer producing them).
        label: the width's label (default ``"<path>.width"``); the embedding width's label to follow it.
        eps: as for ``nn.LayerNorm``.
        elementwise_affine: as for ``nn.LayerNorm``.
        bias: as for ``nn.LayerNorm``.
    """

    def __init__(self, normalized_shape: Sizes, label: str | None = None, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.sizes = self.add_dim("width", normalized_shape, label)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        width = max(self.sizes)
        self.weight = nn.Parameter(torch.ones(width)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(width)) if elementwise_affine and bias else None

    def reset_parameters(self) -> None:
        """``nn.LayerNorm``'s initialisation: weight 1, bias 0."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        width = self.value("width", self.sizes)
        if x.shape[-1] != width:
            raise RuntimeError(f"{self.where()} expects {width} features in the last dimension, got {x.shape[-1]}. "
                               "Give it the label of the layer producing its input (the embedding width's).")
        try:
            return F.layer_norm(x, (width,), _lead(self.weight, width), _lead(self.bias, width), self.eps)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.LayerNorm(d)`` with the leading ``d`` entries of the weight and bias."""
        width = self.value_in("width", architecture, self.sizes)
        weight, bias = _lead(self.weight, width), _lead(self.bias, width)
        kwargs: dict[str, Any] = {} if weight is None else {"device": weight.device, "dtype": weight.dtype}
        return plain_copy(nn.LayerNorm, self, {"weight": weight, "bias": bias}, width, self.eps,
                          self.elementwise_affine, bias=bias is not None, **kwargs)


class ElasticEmbedding(Elastic):
    """``nn.Embedding`` whose width is a choice: width ``d`` looks up the leading ``d`` columns of the table
    (a token or position embedding under an elastic embedding width).

    Args:
        num_embeddings: the table's rows (vocabulary or positions).
        embedding_dim: a fixed width, or the candidate widths.
        label: the width's label (default ``"<path>.width"``).
        padding_idx: as for ``nn.Embedding``: that row starts at zero and gets no gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: Sizes, label: str | None = None,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise NASPipeConfigError(f"ElasticEmbedding(num_embeddings={num_embeddings!r}): the number of rows, a "
                                     "whole number >= 1.")
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise NASPipeConfigError(f"ElasticEmbedding(padding_idx={padding_idx!r}): a row index below "
                                     f"num_embeddings={num_embeddings}, or None.")
        self.sizes = self.add_dim("width", embedding_dim, label)
        self.num_embeddings = num_embeddings
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.weight = nn.Parameter(torch.empty(num_embeddings, max(self.sizes)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s initialisation of the widest table (normal, the padding row zero)."""
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def _table(self, width: int) -> Tensor:
        table = _lead(self.weight, width, dim=1)
        assert table is not None
        return table

    def forward(self, x: Tensor) -> Tensor:
        try:
            return F.embedding(x, self._table(self.value("width", self.sizes)), self.padding_idx)
        except IndexError as error:  # an index past num_embeddings
            raise IndexError(f"{self.where()}: {error}") from error
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.Embedding(num_embeddings, d)`` holding the leading ``d`` columns."""
        table = self._table(self.value_in("width", architecture, self.sizes))
        return plain_copy(nn.Embedding, self, {"weight": table}, self.num_embeddings, table.shape[1],
                          self.padding_idx, device=table.device, dtype=table.dtype)


class PatchEmbed(nn.Module):
    """A vision transformer's patch projection: ``(B, C, H, W)`` to ``(B, patches, embed_dim)``, a convolution of
    kernel and stride ``patch_size`` (a frozen :class:`ElasticPatchEmbed`).

    Args:
        in_channels: the image channels.
        embed_dim: the output features.
        patch_size: the patch side.
        bias: whether the projection adds a bias.
        device: where to create the weights (as for ``nn.Conv2d``).
        dtype: their dtype (as for ``nn.Conv2d``).
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        patches: Tensor = self.proj(x)
        return patches.flatten(2).transpose(1, 2)


class ElasticPatchEmbed(Elastic):
    """A vision transformer's patch projection whose embedding width is a choice: width ``e`` uses the leading
    ``e`` filters of one convolution (kernel and stride ``patch_size``). ``(B, C, H, W)`` to ``(B, patches, e)``,
    ``H`` and ``W`` multiples of ``patch_size``.

    Args:
        in_channels: the image channels.
        embed_dim: a fixed width, or the candidate embedding widths.
        patch_size: the patch side (any whole number >= 1; not padded, unlike :class:`ElasticConv2d`).
        bias: whether the projection adds a bias.
        label: the embedding width's label (default ``"<path>.width"``).
    """

    def __init__(self, in_channels: int, embed_dim: Sizes, patch_size: int, bias: bool = True,
                 label: str | None = None) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("patch_size", patch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NASPipeConfigError(f"ElasticPatchEmbed({name}={value!r}): a whole number >= 1.")
        self.sizes = self.add_dim("width", embed_dim, label)
        self.in_channels, self.patch_size = in_channels, patch_size
        # the widest projection with nn.Conv2d's initialisation; the forward slices its leading filters
        self.proj = nn.Conv2d(in_channels, max(self.sizes), patch_size, patch_size, bias=bias)

    def _slices(self, width: int) -> tuple[Tensor, Tensor | None]:
        weight = _lead(self.proj.weight, width)
        assert weight is not None
        return weight, _lead(self.proj.bias, width)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.shape[-1] % self.patch_size or \
                x.shape[-2] % self.patch_size:
            raise RuntimeError(f"{self.where()} takes images (B, {self.in_channels}, H, W) with H and W multiples of "
                               f"{self.patch_size}, got {tuple(x.shape)}: resize or pad them, or change patch_size.")
        try:
            weight, bias = self._slices(self.value("width", self.sizes))
            return F.conv2d(x, weight, bias, self.patch_size).flatten(2).transpose(1, 2)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """:class:`PatchEmbed` with the leading filters of the chosen width."""
        weight, bias = self._slices(self.value_in("width", architecture, self.sizes))
        frozen = PatchEmbed(self.in_channels, weight.shape[0], self.patch_size, bias is not None, device="meta")
        frozen.proj = plain_copy(nn.Conv2d, self.proj, {"weight": weight, "bias": bias}, self.in_channels,
                                 weight.shape[0], self.patch_size, self.patch_size, bias=bias is not None,
                                 device=weight.device, dtype=weight.dtype)
        return frozen
