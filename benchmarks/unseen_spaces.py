"""Spaces nobody tuned the library for, to check defaults on: not in the zoo's table, used by ``layouts.py
--spaces shufflenet``.

- ``shufflenet``: a ShuffleNetV2-style space of 20 blocks (a trainable stem, 18 choice blocks of 4 candidates
  in 3 stages, a trainable head), 3x32x32 random images, chunks 4, as the issue that asked for a split that holds
  described it.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from spos_cnn import CLASSES, random_images
from zoo_spaces import Space

#: (output channels, choice blocks) per stage; each stage's first block halves the resolution.
SHUFFLE_STAGES = ((48, 6), (96, 6), (192, 6))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: (stride 1) half the channels through 1x1 - depthwise kxk - 1x1, the other half
    kept; (stride 2) both halves computed from the whole input; concatenated and shuffled. ``xception``: three
    depthwise 3x3 convolutions instead of one kxk (ShuffleNetV2+ / SPOS's fourth candidate)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, xception: bool = False) -> None:
        super().__init__()
        self.stride = stride
        inner = cout // 2
        source = cin if stride == 2 else cin // 2
        if xception:  # depthwise 3x3 + pointwise, three times
            widths = [(source, inner, stride), (inner, inner, 1), (inner, inner, 1)]
            self.branch = nn.Sequential(*[m for a, b, s in widths for m in (_conv_bn(a, a, 3, s, a, False),
                                                                             _conv_bn(a, b, 1))])
        else:
            self.branch = nn.Sequential(_conv_bn(source, inner, 1),
                                        _conv_bn(inner, inner, kernel, stride, inner, False),
                                        _conv_bn(inner, inner, 1))
        self.proj = (nn.Sequential(_conv_bn(cin, cin, 3, 2, cin, False), _conv_bn(cin, cout - inner, 1))
                     if stride == 2 else None)

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is None:
            kept, x = x.chunk(2, dim=1)
        else:
            kept = self.proj(x)
        out = torch.cat((kept, self.branch(x)), dim=1)
        n, c, h, w = out.shape
        return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)  # channel shuffle


class ShuffleNetSpace(lnp.NASPipeMixin, pl.LightningModule):
    """Trainable stem, 18 ShuffleNetV2 choice blocks (kernel 3/5/7 or xception), trainable head."""

    def __init__(self, stem: int = 24, head: int = 256) -> None:
        super().__init__()
        blocks: list[nn.Module] = [_conv_bn(3, stem, 3)]
        cin = stem
        for cout, count in SHUFFLE_STAGES:
            for i in range(count):
                stride = 2 if i == 0 else 1
                blocks.append(lnp.ChoiceBlock({**{f"k{k}": ShuffleUnit(cin, cout, k, stride) for k in (3, 5, 7)},
                                               "xception": ShuffleUnit(cin, cout, 3, stride, xception=True)}))
                cin = cout
        blocks.append(nn.Sequential(_conv_bn(cin, head, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                    nn.Linear(head, CLASSES)))
        self.supernet = lnp.Supernet(*blocks)

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=4e-5)


def shufflenet(quick: bool) -> Space:
    size, batch = (16, 32) if quick else (32, 64)
    return Space("shufflenet", f"ShuffleNetV2-style, 20 blocks, 3x{size}x{size} random images", ShuffleNetSpace,
                 lambda n: random_images(n * batch, batch, size), batch, subnets=48 if quick else 160, chunks=4)


UNSEEN = {"shufflenet": shufflenet}
