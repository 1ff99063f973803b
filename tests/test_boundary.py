"""Partition independence: random DAG/tuple spaces give bitwise the one-stage result at every cut.

Spaces mix what broke 0.1 and what users write: one tensor twice in a tuple, a tensor passed on
and also used before the cut, unused outputs, dicts and non-tensor values between blocks, zero
ops, BatchNorm, dropout, a choice nested in a fixed block, a choice inside a choice, and tied
candidates. Each is trained on one stage, then on two (every allowed cut) and three stages,
windows 1 and 8, in process (tests/inprocess.py), and compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.space.boundary import (backward_through, cut, grad_targets, leaf_grads, map_tensors,
                                                  tensors_in)
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.placement.partition import shared_buffer_cuts
from lightning_naspipe.pipeline.placement.moves import first_blocks
from inprocess import train_pipelined
from test_engine import FakeModule

W = 4


def _pair(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(value, dict):
        return value["h"], value["s"]
    return value[0], value[1]


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, W)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h  # one tensor twice


class Apply(nn.Module):
    """``(h, s) -> (op(h), s)``: ``s`` passes through unchanged."""

    def __init__(self, op: nn.Module) -> None:
        super().__init__()
        self.op = op

    def forward(self, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, s = _pair(value)
        return self.op(h), s


class Residual(nn.Module):
    """``(h, s) -> (h + op(s), h)``: ``h`` is used here and passed on."""

    def __init__(self, op: nn.Module) -> None:
        super().__init__()
        self.op = op

    def forward(self, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, s = _pair(value)
        return h + self.op(s), h


class Extras(nn.Module):
    """Emits a dict with non-tensor values and an unused tensor."""

    def forward(self, value: Any) -> dict[str, Any]:
        h, s = _pair(value)
        return {"h": torch.tanh(h), "s": s, "unused": h * 3, "depth": 2, "none": None}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, 2)

    def forward(self, value: Any) -> torch.Tensor:
        h, s = _pair(value)
        return self.lin(h * s)


class Zero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0


def _candidates(rng: random.Random, tied: nn.Linear) -> list[nn.Module]:
    pool: list[nn.Module] = [nn.Linear(W, W), nn.Identity(), Zero(), nn.BatchNorm1d(W),
                             nn.Sequential(nn.Dropout(0.3), nn.Linear(W, W)), tied,
                             lnp.ChoiceBlock([nn.Linear(W, W), nn.Tanh()])]  # a choice inside a choice
    return rng.sample(pool, rng.randint(2, 4))


def random_space(seed: int) -> lnp.Supernet:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tied = nn.Linear(W, W)
    # Half the spaces choose among stems, so the next window's forwards can run early (lookahead).
    blocks: list[nn.Module] = [Stem() if rng.random() < 0.5 else lnp.ChoiceBlock([Stem(), Stem(), Stem()])]
    for i in range(rng.randint(2, 5)):
        kind = rng.choice(["choice", "residual", "extras", "nested"])
        label = rng.choice([None, "shared"])
        if kind == "extras":
            blocks.append(Extras())
            continue
        count = 3 if label == "shared" else rng.randint(2, 4)
        cands = _candidates(rng, tied)[:count]
        while len(cands) < count:
            cands.append(nn.Identity())
        choice = lnp.ChoiceBlock([copy.deepcopy(c) if c is not tied else tied for c in cands], label=label)
        if kind == "choice":
            blocks.append(Apply(choice))
        elif kind == "residual":
            blocks.append(Residual(choice))
        else:  # a ChoiceBlock inside a fixed block with its own weights
            blocks.append(nn.Sequential(Apply(nn.Linear(W, W)), Residual(choice)))
    blocks.append(Head())
    return lnp.Supernet(*blocks)


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(count)]


def _train(net: lnp.Supernet, ranges: list[range], data: list, window: int, chunks: int,
           defer: bool | None = None) -> tuple[Any, ...]:
    module = FakeModule(copy.deepcopy(net))
    if len(ranges) == 1:
        engine = Engine(ranges, chunks=chunks)
        losses = [loss for start in range(0, len(data), window)
                  for loss in engine.train_window(module, data[start:start + window], start).losses]
    else:
        losses = train_pipelined(module, ranges, data, window, chunks, defer_weight_grads=defer)
    return module.supernet.state_dict(), module.optimizer.state_dict()["state"], losses


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...], where: str) -> None:
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), f"{where}: {name} differs"
    assert a[1].keys() == b[1].keys(), f"{where}: optimizer state keys differ"
    for key in a[1]:
        for field in a[1][key]:
            assert torch.equal(a[1][key][field], b[1][key][field]), f"{where}: optimizer {key}.{field} differs"
    assert len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2])), f"{where}: losses"


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), chunks=st.sampled_from([1, 2]), defer=st.sampled_from([None, True, False]))
def test_every_cut_gives_the_one_stage_result(seed: int, chunks: int, defer: bool | None) -> None:
    """``defer``: every stage but the first sends its input gradients before it computes its weight
    gradients (:mod:`lightning_naspipe.pipeline.exactness.weight_grads`) in every window (``True``), never
    (``False``), or
    as measured (``None``)."""
    net = random_space(seed)
    data = _batches(10, seed)
    forbidden = shared_buffer_cuts(net)  # a Linear tied across blocks may be cut: each stage holds a copy
    reference = _train(net, [range(len(net))], data, 1, chunks)
    cuts = [j for j in range(1, len(net)) if j not in forbidden]
    for j in cuts:
        for window in (1, 8):
            got = _train(net, [range(0, j), range(j, len(net))], data, window, chunks, defer)
            _assert_same(reference, got, f"seed {seed}, cut {j}, window {window}")
    if len(cuts) >= 2:
        a, b = random.Random(seed).sample(cuts, 2)
        a, b = min(a, b), max(a, b)
        got = _train(net, [range(0, a), range(a, b), range(b, len(net))], data, 8, chunks, defer)
        _assert_same(reference, got, f"seed {seed}, cuts {a} and {b}")


def test_cut_makes_one_leaf_per_position_with_the_same_flags() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    value = cut((y, y, 5, {"n": None, "i": torch.arange(2)}))
    assert value[0] is not value[1] and value[0].is_leaf and value[0].requires_grad
    assert value[2] == 5 and value[3]["n"] is None and not value[3]["i"].requires_grad
    assert grad_targets(value) == [value[0], value[1]]


def test_tensor_walks_match_pytree_on_every_structure() -> None:
    """map_tensors and tensors_in take a shortcut for plain tuples and lists of tensors: the same
    tensors in the same order, the same structure, as torch's pytree walk gives, shortcut or not."""
    import collections

    import torch.utils._pytree as pytree

    a, b = torch.randn(2, requires_grad=True), torch.randn(3)
    pair = collections.namedtuple("pair", "x y")
    for value in [(a, b), [a, None, b], (a, a), (), [None], ((a,), b), [a, 1.5], {"x": a, "y": [b]}, pair(a, b)]:
        expected = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        found = tensors_in(value)
        assert len(found) == len(expected) and all(x is y for x, y in zip(found, expected)), value
        doubled = map_tensors(lambda t: t * 2, value)
        reference = pytree.tree_map(lambda leaf: leaf * 2 if isinstance(leaf, torch.Tensor) else leaf, value)
        assert type(doubled) is type(reference) and pytree.tree_structure(doubled) == pytree.tree_structure(reference)
        assert all(torch.equal(x, y) for x, y in zip(tensors_in(doubled), tensors_in(reference)))


def test_backward_through_a_boundary_sends_none_not_zeros() -> None:
    w = nn.Parameter(torch.ones(3))
    used, unused = w * 2, w * 3
    leaves = cut((used, unused))
    leaves[0].sum().backward()
    grads = leaf_grads(leaves)
    assert grads[1] is None  # no gradient flowed: sending zeros would make Adam step `w` for nothing
    backward_through((used, unused), grads)
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_tied_weight_is_one_resource_and_serialises_csp() -> None:
    torch.manual_seed(0)
    embedding, head = nn.Embedding(7, W), nn.Linear(W, 7, bias=False)
    head.weight = embedding.weight  # tied embedding and head, as in language models
    a, b = nn.Linear(W, W), nn.Linear(W, W)
    b.weight = a.weight  # tied candidates in two different modules
    net = lnp.Supernet(embedding, lnp.ChoiceBlock([a, nn.Identity()], label="x"),
                       lnp.ChoiceBlock([nn.Identity(), b], label="y"), head)
    both = net.resources(range(len(net)), {"x": 0, "y": 1})
    only_b = net.resources(range(len(net)), {"x": 1, "y": 1})
    only_a = net.resources(range(len(net)), {"x": 0, "y": 0})
    assert net.resource_blocks((0, -1)) == [0, 3]  # embedding and head: one resource
    assert (1, 0) in only_a and (1, 0) in only_b and (1, 0) in both  # a and b: one resource
    assert len(both) == 2


def test_tied_candidates_train_exactly_when_csp_would_overlap_them() -> None:
    torch.manual_seed(1)
    a, b = nn.Linear(W, W), nn.Linear(W, W)
    b.weight = a.weight  # keyed by module, subnets using a and b would overlap and race on one weight
    net = lnp.Supernet(Stem(), Apply(nn.Linear(W, W)), Apply(lnp.ChoiceBlock([a, nn.Identity()], label="x")),
                       Apply(lnp.ChoiceBlock([nn.Identity(), b], label="y")), Head())
    assert shared_buffer_cuts(net) == set()  # the tied Linear may be cut: tests/test_ties.py
    data = _batches(16, 4)
    reference = _train(net, [range(len(net))], data, 1, 1)
    for ranges in ([range(0, 2), range(2, 5)], [range(0, 2), range(2, 4), range(4, 5)], [range(0, 3), range(3, 5)]):
        _assert_same(reference, _train(net, ranges, data, 8, 1), f"stages {ranges}")


class TransformerLayer(nn.Module):
    """One residual layer with a choice of attention and a choice of MLP inside it (nested choices)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = lnp.ChoiceBlock({"heads1": nn.MultiheadAttention(width, 1, batch_first=True),
                                          "heads2": nn.MultiheadAttention(width, 2, batch_first=True)})
        self.mlp = lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)),
                                    nn.Identity(),
                                    lnp.ChoiceBlock([nn.Linear(width, width), nn.Dropout(0.2)])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(len(x), 1, 8).expand(len(x), 3, 8).contiguous()


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mean(1))


def test_transformer_layers_with_nested_choices_are_exact_at_every_cut() -> None:
    torch.manual_seed(2)
    net = lnp.Supernet(Embed(), TransformerLayer(8), TransformerLayer(8), TransformerLayer(8), Pool())
    assert "block1.attention" in net.labels and "block1.mlp.candidates.2" in net.labels
    data = _batches(12, 5)
    reference = _train(net, [range(len(net))], data, 1, 1)
    for j in range(1, len(net)):
        _assert_same(reference, _train(net, [range(0, j), range(j, len(net))], data, 8, 1), f"cut {j}")


def test_in_place_first_op_is_explained() -> None:
    net = lnp.Supernet(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with pytest.raises(lnp.NASPipeConfigError, match="in place.*inplace=False"):
        Engine([range(3)]).train_window(FakeModule(net), _batches(1, 0), 0)


def _two_process_worker(rank: int, init_method: str, results: dict, seeds: tuple[int, ...] = (3, 11)) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_naspipe.transport.p2p import P2PTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    for seed in seeds:
        net = random_space(seed)
        cut_at = min(j for j in range(2, len(net)) if j not in shared_buffer_cuts(net))
        ranges = [range(0, cut_at), range(cut_at, len(net))]
        module = FakeModule(net)
        transport = P2PTransport(rank, [0, 1], torch.device("cpu"), timedelta(seconds=120))
        engine = Engine(ranges, stage=rank, chunks=2, transport=transport)
        data = _batches(10, seed)
        losses = [loss for start in range(0, 10, 8) for loss in engine.train_window(module, data[start:start + 8],
                                                                                     start).losses]
        first = first_blocks(list(net.blocks))  # a weight tied across the cut: its first block's stage steps it
        own = {name: t.detach() for name, t in net.state_dict(keep_vars=True).items() if first[id(t)] in ranges[rank]}
        results[(seed, rank)] = (own, losses)
    dist.destroy_process_group()


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
def test_random_spaces_on_two_stage_processes_equal_one_stage() -> None:
    from helpers import spawn_gloo_pair

    results = spawn_gloo_pair(_two_process_worker)
    for seed in (3, 11):
        state, _, losses = _train(random_space(seed), [range(len(random_space(seed)))], _batches(10, seed), 1, 2)
        for rank in (0, 1):
            own, got_losses = results[(seed, rank)]
            for name, tensor in own.items():
                assert torch.equal(tensor, state[name]), f"seed {seed}: {name} differs on rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(got_losses, losses)) and len(got_losses) == len(losses)


class ChannelsLastStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.view(len(x), 1, 1, 5).expand(len(x), 1, 3, 5)).to(memory_format=torch.channels_last)


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(15, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.mean(1).flatten(1)  # (N, 15)
        return self.lin(flat).t(), flat  # a non-contiguous view, and a tensor used here and passed on


class FromTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(19, 2)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(torch.cat([value[0].t(), value[1]], 1))


def test_layouts_crossing_a_cut_are_the_in_process_layouts() -> None:
    torch.manual_seed(3)
    net = lnp.Supernet(ChannelsLastStem(), lnp.ChoiceBlock([nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.Identity()]),
                       Transposed(), FromTransposed())
    data = _batches(8, 6)
    reference = _train(net, [range(len(net))], data, 1, 2)
    for j in range(1, len(net)):
        _assert_same(reference, _train(net, [range(0, j), range(j, len(net))], data, 8, 2), f"cut {j}")
