"""Supernet.freeze and recalibrate_batchnorm over a zoo of spaces: DAG cells, input choices,
trainable stem and head, tied weights across blocks, nested choices and tuples between blocks."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from helpers import FEATURES, ToyNet
from lightning_naspipe.space.cells import Cell
from lightning_naspipe.space.choice import active_architecture
from lightning_naspipe.space.freezing import freeze_block
from test_cells import C, darts_op, nb201_op

torch.set_num_threads(1)


class _Attention(nn.Module):
    """A transformer-ish layer: a fixed block with two nested choices, passing (hidden, mask) on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = lnp.ChoiceBlock([nn.Linear(width, width),
                                    nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))])
        self.mlp = lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)),
                                    nn.Identity()])

    def forward(self, value: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = value
        hidden = hidden + self.mix(hidden) * mask
        return hidden + self.mlp(hidden), mask


class _Embed(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.embedding(tokens), (tokens > 0).float().unsqueeze(-1)


class _TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight  # tied with the input embedding, in another block

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        return value[0] @ self.weight.t()


def _charlm() -> tuple[lnp.Supernet, Tensor]:
    embedding = nn.Embedding(11, 8)
    return lnp.Supernet(_Embed(embedding), _Attention(8), _Attention(8), _TiedHead(embedding)), \
        torch.randint(0, 11, (3, 5))


def _nb201() -> tuple[lnp.Supernet, Tensor]:
    head = nn.Sequential(nn.Flatten(), nn.Linear(C * 25, 4))
    return lnp.Supernet(nn.Conv2d(3, C, 3, padding=1), Cell(4, nb201_op), head), torch.randn(2, 3, 5, 5)


def _darts() -> tuple[lnp.Supernet, Tensor]:
    stem = nn.Conv2d(3, C, 1)
    return lnp.Supernet(_Twice(stem), Cell(5, darts_op, inputs=2, choose=2, output="concat", chain=True),
                        nn.Sequential(_Last(), nn.Flatten(), nn.LazyLinear(3))), torch.randn(2, 3, 4, 4)


class _Twice(nn.Module):
    def __init__(self, stem: nn.Module) -> None:
        super().__init__()
        self.stem = stem

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        s = self.stem(x)
        return s, s


class _Last(nn.Module):
    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        return value[-1]


def _toy() -> tuple[lnp.Supernet, Tensor]:
    return ToyNet().supernet, torch.randn(4, FEATURES)


SPACES: dict[str, Callable[[], tuple[lnp.Supernet, Tensor]]] = {
    "toy": _toy, "nb201": _nb201, "darts": _darts, "charlm-tied": _charlm}


def _architectures(supernet: lnp.Supernet, count: int, seed: int = 0) -> list[dict[str, int]]:
    rng = random.Random(seed)
    return [{label: rng.randrange(n) for label, n in supernet.labels.items()} for _ in range(count)]


def _trained(name: str) -> tuple[lnp.Supernet, Tensor]:
    """A space whose weights and BatchNorm statistics moved away from their initial values."""
    torch.manual_seed(0)
    supernet, x = SPACES[name]()
    supernet.eval()
    supernet(x, _architectures(supernet, 1)[0])  # materialise lazy modules
    optimizer = torch.optim.SGD(supernet.parameters(), lr=0.05)
    supernet.train()
    for arch in _architectures(supernet, 6, seed=1):
        out = supernet(x, arch)
        torch.tanh(out).mean().backward()  # bounded: no space diverges
        optimizer.step()
        optimizer.zero_grad()
    return supernet, x


def _state(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("name", list(SPACES))
def test_frozen_subnet_equals_the_supernet_bitwise_and_leaves_it_untouched(name: str) -> None:
    supernet, x = _trained(name)
    supernet.eval()
    before = _state(supernet)
    every_block = range(len(supernet))
    for arch in _architectures(supernet, 8, seed=2):
        frozen = supernet.freeze(arch)
        assert isinstance(frozen, nn.Sequential) and not frozen.training
        assert not any(isinstance(m, (lnp.ChoiceBlock, lnp.When)) for m in frozen.modules())
        with torch.no_grad():
            assert torch.equal(frozen(x), supernet(x, arch))  # runs without an active architecture
        # Exactly the subnet's own tensors were copied, each once (ties stay ties), none shared.
        used = {p for key in supernet.resources(every_block, arch) for p in supernet.resource_state(key).params}
        assert sum(p.numel() for p in frozen.parameters()) == sum(p.numel() for p in used)
        assert not {id(p) for p in frozen.parameters()} & {id(p) for p in supernet.parameters()}
    after = supernet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_tied_weights_stay_tied_and_reinitialize_resets_them_once() -> None:
    supernet, x = _trained("charlm-tied")
    arch = _architectures(supernet, 1)[0]
    frozen = supernet.freeze(arch)
    assert frozen[0].embedding.weight is frozen[3].weight
    torch.manual_seed(5)
    fresh = supernet.freeze(arch, reinitialize=True)
    assert fresh[0].embedding.weight is fresh[3].weight
    assert not torch.equal(fresh[0].embedding.weight, frozen[0].embedding.weight)
    torch.manual_seed(5)
    again = supernet.freeze(arch, reinitialize=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), again.state_dict().values()))


def test_a_module_that_runs_in_one_place_and_is_unchosen_in_another_stays_whole() -> None:
    """Block 0 is also block 1's first candidate; with the second chosen, block 0 still runs (it froze to Inactive,
    counting 0 parameters, before)."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    supernet = lnp.Supernet(shared, lnp.ChoiceBlock([shared, nn.Linear(4, 4)]))
    x = torch.randn(3, 4)
    for choice in (0, 1):
        architecture = {label: choice for label in supernet.labels}
        frozen, block = supernet.freeze(architecture), freeze_block(supernet, 0, architecture)
        assert isinstance(frozen[0], nn.Linear) and isinstance(block, nn.Linear)
        assert torch.equal(frozen[0].weight, shared.weight) and torch.equal(block.weight, shared.weight)
        assert torch.equal(frozen(x), supernet(x, architecture))


def test_freeze_refuses_a_bad_architecture_and_a_stage_local_supernet() -> None:
    supernet, _ = _toy()
    with pytest.raises(lnp.NASPipeConfigError, match="lacks a choice"):
        supernet.freeze({})
    supernet.local_blocks = range(0, 2)
    with pytest.raises(RuntimeError, match="freeze after fit"):
        supernet.freeze(_architectures(supernet, 1)[0])


def test_recalibration_is_the_exact_cumulative_mean_and_keeps_mode_and_momentum() -> None:
    supernet, x = _trained("nb201")
    arch = {label: 3 for label in supernet.labels}  # every edge conv3x3: BatchNorm everywhere
    frozen = supernet.freeze(arch).eval()
    batches = [torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    lnp.recalibrate_batchnorm(frozen, batches)
    assert not frozen.training
    norms = [m for m in frozen.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.momentum == 0.1 for m in norms)
    # By hand: fresh statistics, cumulative mean, every other module in eval mode.
    reference = supernet.freeze(arch).eval()
    for m in reference.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
            m.train()
    with torch.no_grad():
        for batch in batches:
            reference(batch)
    assert all(torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
               for a, b in zip(norms, (m for m in reference.modules() if isinstance(m, nn.BatchNorm2d))))
    assert all(int(m.num_batches_tracked) == 3 for m in norms)
    with torch.no_grad():  # the supernet's own statistics are not the recalibrated ones
        assert not torch.equal(supernet.freeze(arch).eval()(x), frozen(x))


def test_frozen_subnet_runs_under_an_active_architecture_of_another_subnet_too() -> None:
    supernet, x = _trained("toy")
    supernet.eval()
    first, second = _architectures(supernet, 2, seed=3)
    frozen = supernet.freeze(first)
    with torch.no_grad(), active_architecture(second):
        assert torch.equal(frozen(x), supernet(x, first))
