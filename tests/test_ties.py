"""Weights tied across stages (lightning_naspipe.pipeline.exactness.ties): a GPT-style space whose output head shares
the token
embedding's weight trains on 2 and 3 stages bit for bit as on one device (torch.equal: weights, Adam state,
per-subnet losses), each stage a module copy of its own as stage processes hold (in-process threads,
tests/inprocess.py); the multi-process run with checkpoints and a resume: tests/test_ties_stages.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from inprocess import train_pipelined
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.placement.partition import stage_ranges
from lightning_naspipe.pipeline.placement.moves import first_blocks, owner_of
from lightning_naspipe.pipeline.exactness.ties import StageTies, ties_of
from test_engine import FakeModule

VOCAB, WIDTH, LENGTH = 13, 8, 6
MAX_NORM = 0.5


class Embed(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)
        self.drop = nn.Dropout(0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embedding(tokens) + self.position)


class Attention(nn.Module):
    """A pre-norm residual self-attention layer with dropout."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, heads, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        return x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class Head(nn.Module):
    def __init__(self, embedding: nn.Embedding | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, VOCAB, bias=False)
        if embedding is not None:
            self.proj.weight = embedding.weight  # tied: one Parameter, as in GPT-2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class TiedMix(nn.Module):
    """A residual block reading the tied weight too (as a layer scoring tokens mid-network would)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight
        return x + 0.1 * torch.tanh(x @ weight.t()) @ weight


def gpt(layers: int = 4, choices: bool = False, mix_at: int | None = None) -> lnp.Supernet:
    """Embedding, ``layers`` choice blocks (attention, MLP, identity), a head tied to the embedding. With
    ``choices`` the embedding and the head are choices between the tied module and untied ones, so subnets
    use the tied weight on the first stage only, the last only, both or neither. ``mix_at``: a block reading
    the tied weight too, at that position."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    blocks: list[nn.Module] = [Embed(embedding)]
    if choices:
        blocks = [lnp.ChoiceBlock([blocks[0], *(Embed(nn.Embedding(VOCAB, WIDTH)) for _ in range(3))], label="embed")]
    for _ in range(layers):
        blocks.append(lnp.ChoiceBlock([Attention(2), Attention(1), MLP(16), MLP(8), MLP(24), nn.Identity()]))
    if mix_at is not None:
        blocks.insert(mix_at, TiedMix(embedding))
    head = Head(embedding)
    blocks.append(lnp.ChoiceBlock([head, *(Head(None) for _ in range(3))], label="head") if choices else head)
    return lnp.Supernet(*blocks)


class GPTModule(FakeModule):
    """Next-token cross-entropy, Adam; ``clip``: clip each subnet's gradients by their global norm in the step,
    as Lightning's clip_gradients does (over the optimizer's parameters, restricted to the subnet's)."""

    def __init__(self, supernet: lnp.Supernet, clip: bool = False) -> None:
        super().__init__(supernet)
        self.optimizer = torch.optim.Adam(supernet.parameters(), lr=0.01)
        self.clip = clip

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def optimizers(self) -> Any:
        return SimpleNamespace(optimizer=self.optimizer, step=self._step)

    def _step(self) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], MAX_NORM)
        self.optimizer.step()


def batches(count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (size, LENGTH + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def one_device(net: lnp.Supernet, data: list[Any], chunks: int, clip: bool = False) -> tuple[GPTModule, list[Any]]:
    """The plain run: the mixin's sequential path is the engine with one stage."""
    module = GPTModule(copy.deepcopy(net), clip)
    engine = Engine([range(len(net))], chunks=chunks)
    losses = [loss for i, batch in enumerate(data) for loss in engine.train_window(module, [batch], i).losses]
    return module, losses


def assert_owners_equal(reference: GPTModule, modules: list[GPTModule], ranges: list[range]) -> None:
    """Every parameter and its Adam state on its owner (the stage of its first block) equal the plain run's;
    a stage holding a copy of a weight tied to an earlier stage keeps no optimizer state of it."""
    first = first_blocks(list(reference.supernet.blocks))
    ref_params = list(reference.supernet.parameters())
    for index, (name, ref) in enumerate(reference.supernet.named_parameters()):
        owner = owner_of(ranges, first[id(ref)])
        for s, module in enumerate(modules):
            p = list(module.supernet.parameters())[index]
            if s == owner:
                assert torch.equal(p, ref), f"{name} on stage {s}"
                assert (p in module.optimizer.state) == (ref in reference.optimizer.state), name
                for key, value in reference.optimizer.state.get(ref, {}).items():
                    assert torch.equal(module.optimizer.state[p][key], value), (name, key)
            else:
                assert p not in module.optimizer.state, f"stage {s} stepped {name}, owned by stage {owner}"
            assert p.grad is None
    assert len(ref_params) == len(list(modules[0].supernet.parameters()))


def pipelined(net: lnp.Supernet, ranges: list[range], data: list[Any], window: int, chunks: int,
              defer: bool | None = None, clip: bool = False, engines: list[Engine] | None = None,
              offload: bool = False, schedule: str = "csp") -> tuple[list[GPTModule], list[Any]]:
    modules = [GPTModule(copy.deepcopy(net), clip) for _ in ranges]
    losses = train_pipelined(modules, ranges, data, window, chunks, schedule, engines=engines,  # type: ignore[arg-type]
                             defer_weight_grads=defer, clip_norms=clip or None, offload=offload)
    return modules, losses


def test_the_default_split_puts_a_tied_embedding_and_head_on_different_stages() -> None:
    net = gpt()
    for stages in (2, 3):
        ranges = stage_ranges(net, stages)
        ties = StageTies(net, ranges)
        assert len(ties.shared) == 1 and ties.shared[0].tensor is net.blocks[0].embedding.weight
        assert ties.shared[0].owner == 0 and list(ties.shared[0].blocks) == [0, stages - 1]
        assert ties.homes == {(0, -1): frozenset({0})}
    assert ties_of(net, [range(len(net))]) is None, "one stage: nothing to tie"


@pytest.mark.parametrize(("stages", "window", "chunks", "defer"), [
    (2, 1, 1, None), (2, 4, 2, None), (3, 4, 1, True), (3, 3, 3, None)])
def test_gpt_with_a_tied_head_on_stages_equals_one_device(stages: int, window: int, chunks: int,
                                                          defer: bool | None) -> None:
    net, data = gpt(), batches(9)
    reference, ref_losses = one_device(net, data, chunks)
    ranges = stage_ranges(net, stages)
    modules, losses = pipelined(net, ranges, data, window, chunks, defer)
    assert len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert_owners_equal(reference, modules, ranges)


@pytest.mark.parametrize(("ranges", "chunks"), [
    ([range(0, 3), range(3, 6)], 2), ([range(0, 1), range(1, 5), range(5, 6)], 1)])
def test_tied_choices_lookahead_and_deferred_weight_gradients_on_stages_equal_one_device(
        ranges: list[range], chunks: int) -> None:
    """Subnets that use the tied weight only in the head (its owner steps it from the gradient the last stage
    sends), only in the embedding, or not at all: independent ones overlap, the next window's forwards run
    ahead, and the later stages send input gradients before weight gradients (but a tied copy's)."""
    net, data = gpt(layers=4, choices=True), batches(16)
    reference, ref_losses = one_device(net, data, chunks)
    engines: list[Engine] = []
    modules, losses = pipelined(net, ranges, data, 4, chunks, defer=True, engines=engines)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert_owners_equal(reference, modules, ranges)
    assert engines[0].forwards_ahead > 0
    uses = {(a["embed"] == 0, a["head"] == 0) for a in (modules[0].sample_subnet(i) for i in range(16))}
    assert {(True, False), (False, True)} <= uses, "some subnets use the tied weight on one stage only"


@pytest.mark.parametrize(("ranges", "chunks"), [
    ([range(0, 3), range(3, 7)], 2), ([range(0, 2), range(2, 5), range(5, 7)], 2)])
def test_several_blocks_reading_the_tied_weight_on_later_stages(ranges: list[range], chunks: int) -> None:
    """Three blocks read the weight: each later block's contribution travels on its own, last block first (the
    one-device sum, not a stage's partial sum), through a stage that reads it and relays the last one's."""
    net, data = gpt(mix_at=3), batches(8)
    reference, ref_losses = one_device(net, data, chunks)
    modules, losses = pipelined(net, ranges, data, 4, chunks)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert_owners_equal(reference, modules, ranges)


def test_offloaded_stages_equal_one_device() -> None:
    """Each stage keeps its blocks in host memory between uses: a holder's copy is written into the device copy
    its resource has while in flight, and goes back to the host with it."""
    net, data = gpt(choices=True, mix_at=3), batches(8)
    reference, ref_losses = one_device(net, data, 2)
    ranges = [range(0, 2), range(2, 5), range(5, 7)]
    engines: list[Engine] = []
    modules, losses = pipelined(net, ranges, data, 4, 2, engines=engines, offload=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert_owners_equal(reference, modules, ranges)
    assert all(e.offloader is not None and e.offloader.stats.prefetch_hits + e.offloader.stats.prefetch_misses > 0
               for e in engines)


@pytest.mark.parametrize("schedule", ["gpipe", "one_in_flight", "async"])
def test_baseline_schedules_with_a_tied_weight(schedule: str) -> None:
    """The baselines keep the contract with a tied weight; "async" (updates at the window's end, every holder
    reading the value of the window's start) runs and is not exact, as without ties."""
    net, data = gpt(choices=True, mix_at=3), batches(8)
    reference, ref_losses = one_device(net, data, 2)
    ranges = [range(0, 2), range(2, 5), range(5, 7)]
    modules, losses = pipelined(net, ranges, data, 4, 2, schedule=schedule)
    exact = len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert exact == (schedule != "async")
    if exact:
        assert_owners_equal(reference, modules, ranges)


def test_stages_sharing_one_module_equal_one_device() -> None:
    """Stage threads over one module (the other tests' setting): a holder's copy is the owner's tensor, so its
    contributions are taken and the owner's .grad kept around each of its blocks' backward."""
    net, data = gpt(), batches(8)
    reference, ref_losses = one_device(net, data, 2)
    module = GPTModule(copy.deepcopy(net))
    losses = train_pipelined(module, [range(0, 2), range(2, 4), range(4, 6)], data, 4, 2)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    for (name, a), b in zip(reference.supernet.state_dict().items(), module.supernet.state_dict().values()):
        assert torch.equal(a, b), name


def test_norm_clipping_counts_the_tied_weight_once_at_its_owner() -> None:
    net, data = gpt(), batches(8)
    reference, ref_losses = one_device(net, data, 1, clip=True)
    unclipped, _ = one_device(net, data, 1)
    assert not torch.equal(reference.supernet.blocks[0].embedding.weight, unclipped.supernet.blocks[0].embedding.weight)
    ranges = [range(0, 2), range(2, 4), range(4, 6)]
    modules, losses = pipelined(net, ranges, data, 4, 1, clip=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert_owners_equal(reference, modules, ranges)


def test_evaluation_on_stages_reads_the_owners_current_weight() -> None:
    """After training, the last stage's copy of the tied weight may be older than the owner's (no later subnet
    read it there): an evaluation forward carries the owner's value along."""
    from inprocess import LocalTransport, _World

    net, data = gpt(), batches(4)
    ranges = [range(0, 3), range(3, 6)]
    modules, _ = pipelined(net, ranges, data, 4, 1)
    owner, holder = (m.supernet.blocks[0].embedding.weight for m in modules)
    holder.data.add_(1.0)  # stale
    whole = copy.deepcopy(modules[1].supernet)
    for b in ranges[0]:
        whole.blocks[b].load_state_dict(modules[0].supernet.blocks[b].state_dict())
    world = _World(2)
    engines = [Engine(ranges, stage=s, transport=LocalTransport(world, s)) for s in range(2)]
    architecture = modules[0].sample_subnet(0)
    for net_ in (whole, *(m.supernet for m in modules)):
        net_.eval()
    with world.baton:
        engines[0].evaluate(modules[0], data[0], architecture)  # type: ignore[arg-type]
        output = engines[1].evaluate(modules[1], data[0], architecture)  # type: ignore[arg-type]
    assert torch.equal(holder, owner)
    assert torch.equal(output, whole(data[0][0], architecture))


def test_a_buffer_shared_across_stages_is_refused() -> None:
    norm = nn.BatchNorm1d(WIDTH)
    net = lnp.Supernet(nn.Linear(4, WIDTH), norm, nn.Linear(WIDTH, WIDTH), norm)
    with pytest.raises(lnp.NASPipeConfigError, match="share a buffer"):
        StageTies(net, [range(0, 2), range(2, 4)])
