"""The search spaces of ``zoo.py``: each a ``NASPipeMixin`` LightningModule plus its data.

Every space is described by a :class:`Space`: how to build the module, a data-loader factory
(embedded or random data drawn from a fixed seed, nothing is downloaded, the same batches in
every process), the batch size and ``chunks``. Spaces that already exist elsewhere in the
repository are imported, not copied:

- ``nb201``: ``examples/nb201_digits.py``'s NB201 cell space on scikit-learn's digits;
- ``spos``: ``spos_cnn.SposCNN`` (trainable stem and head, 4 candidates), chunks 4;
- ``mobilenet``: a MobileNetV2/ProxylessNAS-style space defined here (:class:`MobileNetSpace`);
- ``charlm``: ``space_sweep.CharLM`` with 32 candidates per choice block;
- ``wide_mlp`` and ``wide_mlp_8ms``: :class:`WideMLP`, 8 choice blocks x 32 linear candidates and
  a trainable classification head, at width 512 (batch 128) and 256 (batch 64).

``space(name, quick)`` gives a space's description for a normal or a ``--quick`` run.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp
from lightning_naspipe.space.supernet import supernet_of
from space_sweep import CharLM, text_loader
from spos_cnn import CLASSES, SposCNN, conv_bn, inverted_bottleneck, random_images

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
Loader = DataLoader[tuple[Tensor, ...]]


@dataclass(frozen=True)
class Space:
    """One search space of the zoo, at one size.

    Attributes:
        name: the zoo's name for it (``--spaces``).
        summary: one line describing the model and the data.
        model: builds the LightningModule (a fresh supernet, same weights for a given global seed).
        data: ``data(subnets)`` is a loader of exactly ``subnets`` batches (one per subnet).
        batch: samples per subnet (images or sequences).
        subnets: subnets per run, warm-up included; a multiple of the default window (8).
        warmup: subnets not timed (the first window also times the blocks and moves to that split).
        chunks: the strategy's ``chunks`` (micro-batches per subnet).
    """

    name: str
    summary: str
    model: Callable[[], pl.LightningModule]
    data: Callable[[int], Loader]
    batch: int
    subnets: int
    warmup: int = 16
    chunks: int = 1


def candidate_counts(module: pl.LightningModule) -> tuple[int, int]:
    """The fewest and the most candidates of any choice in ``module``'s supernet."""
    counts = [len(m) for m in supernet_of(module).modules() if isinstance(m, lnp.ChoiceBlock)]
    return min(counts), max(counts)


# -- nb201: the example's NB201 cell space on digits ------------------------------------------------


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` imported as module ``name`` (examples/ is no package), as the tests do."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: pickling resolves classes by module name
        spec.loader.exec_module(module)
    return sys.modules[name]


def nb201_model(channels: int) -> pl.LightningModule:
    """The example's supernet without its ``supernet_example_input``: the zoo runs default settings,
    where the strategy times the blocks on the first training batch itself."""
    module: Any = load_example("nb201_digits").NB201Supernet(channels=channels)
    module.supernet_example_input = None
    return cast(pl.LightningModule, module)


def digits_loader(subnets: int, batch: int) -> Loader:
    """The example's normalized training digits, repeated in order to ``subnets`` batches of ``batch``."""
    data = load_example("nb201_digits").DigitsDataModule(batch_size=batch)
    data.setup("fit")
    x, y = data.train_set.tensors
    index = torch.arange(subnets * batch) % len(y)
    return DataLoader(TensorDataset(x[index], y[index]), batch_size=batch)


def nb201(quick: bool) -> Space:
    channels, batch = 16, 64
    return Space("nb201", f"NB201 cells on digits (examples/nb201_digits.py), C={channels}, 8x8 inputs",
                 lambda: nb201_model(channels), lambda n: digits_loader(n, batch), batch,
                 subnets=200 if quick else 960, warmup=16 if quick else 32)


# -- spos: SPOS-style CNN with trainable stem and head ----------------------------------------------


def spos(quick: bool) -> Space:
    per_resolution, batch = (2, 64) if quick else (3, 128)
    return Space("spos", f"SPOS CNN (spos_cnn.py), {per_resolution} blocks x 3 resolutions, 3x16x16 inputs",
                 lambda: SposCNN(16, per_resolution), lambda n: random_images(n * batch, batch, 16), batch,
                 subnets=32 if quick else 80, chunks=4)


# -- mobilenet: MobileNetV2 / ProxylessNAS-style MBConv space ----------------------------------------

#: (output channels, choice blocks, stride of the first) per stage, as in ProxylessNAS for small images.
MOBILENET_STAGES = ((24, 3, 1), (40, 3, 2), (80, 3, 2), (96, 3, 1))
KERNELS, EXPANSIONS = (3, 5, 7), (3, 6)


def mbconv_choice(cin: int, cout: int, stride: int) -> lnp.ChoiceBlock:
    """MBConv (``spos_cnn.inverted_bottleneck``) with kernel 3/5/7 x expansion 3/6, plus ``skip``
    where the block keeps the shape (stride 1, same channels)."""
    candidates: dict[str, nn.Module] = {f"k{k}e{e}": inverted_bottleneck(cin, cout, k, stride, e)
                                        for k in KERNELS for e in EXPANSIONS}
    if stride == 1 and cin == cout:
        candidates["skip"] = nn.Identity()
    return lnp.ChoiceBlock(candidates)


class MobileNetSpace(lnp.NASPipeMixin, pl.LightningModule):
    """Trainable stem (stride-2 conv), 12 MBConv choice blocks in 4 stages, trainable head.

    Args:
        stem: channels of the stem's output.
        head: channels of the head's 1x1 conv before pooling and the linear classifier.
    """

    def __init__(self, stem: int = 16, head: int = 256) -> None:
        super().__init__()
        blocks: list[nn.Module] = [conv_bn(3, stem, 3, stride=2)]
        cin = stem
        for cout, count, stride in MOBILENET_STAGES:
            for i in range(count):
                blocks.append(mbconv_choice(cin, cout, stride if i == 0 else 1))
                cin = cout
        blocks.append(nn.Sequential(conv_bn(cin, head, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                    nn.Linear(head, CLASSES)))
        self.supernet = lnp.Supernet(*blocks)

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=4e-5)


def mobilenet(quick: bool) -> Space:
    size, batch = (16, 16) if quick else (32, 32)
    return Space("mobilenet", f"MobileNetV2/ProxylessNAS-style MBConv space, 3x{size}x{size} random images",
                 MobileNetSpace, lambda n: random_images(n * batch, batch, size), batch,
                 subnets=48 if quick else 128)


# -- charlm: the space sweep's transformer char-LM, 32 candidates -----------------------------------


def charlm(quick: bool) -> Space:
    layers, width, seq, batch = (4, 64, 64, 16) if quick else (8, 128, 64, 16)
    return Space("charlm", f"char-LM (space_sweep.py), {layers} transformer layers of width {width}, seq {seq}",
                 lambda: CharLM(32, layers, width, seq), lambda n: text_loader(n * batch, seq, batch), batch,
                 subnets=48 if quick else 160, warmup=16 if quick else 32)


# -- wide_mlp, wide_mlp_8ms: 8 choice blocks x 32 linear candidates ---------------------------------


class WideMLP(lnp.NASPipeMixin, pl.LightningModule):
    """``blocks`` choice blocks of ``candidates`` x (Linear(width, width), GELU), then a trainable
    classification head (Linear(width, 10)) every subnet shares; SGD with momentum 0.9."""

    def __init__(self, width: int = 512, blocks: int = 8, candidates: int = 32) -> None:
        super().__init__()
        choices = [lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(candidates)])
                   for _ in range(blocks)]
        self.supernet = lnp.Supernet(*choices, nn.Linear(width, CLASSES))

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def features_loader(subnets: int, width: int, batch: int) -> Loader:
    """``subnets`` batches of random ``width``-feature vectors with random labels (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(subnets * batch, width, generator=gen)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (len(x),), generator=gen)), batch_size=batch)


def wide_mlp_space(name: str, width: int, batch: int, subnets: int) -> Space:
    return Space(name, f"8 choice blocks x 32 (Linear({width}, {width}) + GELU), shared linear head, random data",
                 lambda: WideMLP(width), lambda n: features_loader(n, width, batch), batch, subnets=subnets)


def wide_mlp(quick: bool) -> Space:
    return wide_mlp_space("wide_mlp", 512, 64 if quick else 128, 96 if quick else 480)


def wide_mlp_8ms(quick: bool) -> Space:
    return wide_mlp_space("wide_mlp_8ms", 256, 64, 400 if quick else 1600)


#: The zoo, in the order of the table.
SPACES: dict[str, Callable[[bool], Space]] = {
    "nb201": nb201, "spos": spos, "mobilenet": mobilenet, "charlm": charlm, "wide_mlp": wide_mlp,
    "wide_mlp_8ms": wide_mlp_8ms,
}


def space(name: str, quick: bool = False) -> Space:
    """The space called ``name``, at its ``--quick`` size when ``quick``."""
    return SPACES[name](quick)
