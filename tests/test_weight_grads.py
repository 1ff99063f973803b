"""Input gradients first, weight gradients later: bitwise the one-pass backward, and the chooser."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_naspipe.space.boundary import backward_through, cut, leaf_grads
from lightning_naspipe.pipeline.exactness.weight_grads import DeferralChooser, DeferredWeights, serialised

Block = Callable[[Any], Any]


class TwoInputs(nn.Module):
    """A DAG block: a tuple in, a tuple out, the first input used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.norm = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, xs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = xs
        h = self.norm(torch.tanh(self.a(x)) + self.b(y) * x)
        return h, self.c(h).relu()


def chain(blocks: list[nn.Module], x: Any, deferred: DeferredWeights | None, grads: Any) -> tuple[Any, ...]:
    """Forward through ``blocks`` with a cut at every boundary, then backward last to first, one pass
    per block or with weights deferred; the first block's input gradients."""
    saved = []
    for block in blocks:
        x = cut(x)
        y = block(x)
        saved.append((x, y))
        x = y
    for block, (inputs, outputs) in zip(reversed(blocks), reversed(saved)):
        if deferred is None:
            backward_through(outputs, grads)
            grads = leaf_grads(inputs)
        else:
            grads = deferred.backward(outputs, grads, inputs, list(block.parameters()))
    return grads


def compare(blocks: list[nn.Module], x: Any, grads: Any, expect_deferred: bool = True) -> None:
    one_pass = copy.deepcopy(blocks)
    expected = chain(one_pass, x, None, grads)
    deferred = DeferredWeights()
    got = chain(blocks, x, deferred, grads)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    if expect_deferred:  # the input gradients came first: no weight has a gradient yet
        assert len(deferred) == len(blocks)
        assert all(p.grad is None for block in blocks for p in block.parameters())
    deferred.run()
    assert len(deferred) == 0
    for block, reference in zip(blocks, one_pass):
        for (name, p), q in zip(block.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name


def test_mlp_blocks_defer_every_weight_and_match_one_pass() -> None:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(3)]
    x = torch.randn(5, 8, requires_grad=True)
    compare(blocks, x, (torch.randn(5, 8),))


def test_dag_blocks_with_tuples_norms_and_convs_match_one_pass() -> None:
    torch.manual_seed(1)
    pair = (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True))
    compare([TwoInputs(), TwoInputs()], pair, (torch.randn(3, 4), torch.randn(3, 4)))
    convs: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
                              for _ in range(2)]
    compare(convs, torch.randn(2, 3, 6, 6, requires_grad=True), (torch.randn(2, 3, 6, 6),))


class TwiceUsed(nn.Module):
    """One weight on two paths to the input: two intersections, so one pass."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + torch.tanh(x) @ self.weight


class ParameterOutput(nn.Module):
    """An output that only a parameter feeds: it never crosses the input paths."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bias = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(x), self.bias * 2


@pytest.mark.parametrize("odd", [TwiceUsed, ParameterOutput])
def test_a_block_that_does_not_split_runs_one_pass_after_the_blocks_behind_it(odd: type[nn.Module]) -> None:
    torch.manual_seed(2)
    shared = nn.Linear(4, 4)  # tied across the blocks: the accumulation order into its .grad must hold
    blocks: list[nn.Module] = [nn.Sequential(shared, nn.Tanh()), odd()]
    grads: tuple[Tensor, ...] = (torch.randn(3, 4),)
    if odd is TwiceUsed:
        blocks.append(nn.Sequential(shared, nn.Tanh()))
    else:  # its outputs are the chain's: the parameter-only one takes a gradient too
        grads = (torch.randn(3, 4), torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    one_pass = copy.deepcopy(blocks)
    earlier = torch.randn(4, 4)  # an earlier micro-batch's gradient
    shared.weight.grad = earlier.clone()
    one_pass[0][0].weight.grad = earlier.clone()
    expected = chain(one_pass, x, None, grads)
    deferred = DeferredWeights()
    got = chain(blocks, x, deferred, grads)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert len(deferred) == 1  # the first block; any block after the odd one ran before its single pass
    deferred.run()
    for block, reference in zip(blocks, one_pass):
        for p, q in zip(block.parameters(), reference.parameters()):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


def test_a_tensor_outside_the_given_parameters_is_not_lost() -> None:
    outside = torch.randn(4, 4, requires_grad=True)
    lin = nn.Linear(4, 4)
    x = cut(torch.randn(3, 4, requires_grad=True))
    y = lin(x) @ outside
    deferred = DeferredWeights()
    deferred.backward(y, (torch.ones(3, 4),), x, list(lin.parameters()))
    assert len(deferred) == 0 and outside.grad is not None and lin.weight.grad is not None


def test_the_chooser_alternates_then_defers_when_input_gradients_leave_sooner() -> None:
    chooser = DeferralChooser(trials=2)
    blocks = range(3, 6)
    assert chooser.pick(blocks, first_stage=True, eligible=True) is False
    assert chooser.pick(blocks, first_stage=False, eligible=False) is False
    picks = []
    for _ in range(4):
        picks.append(chooser.pick(blocks, first_stage=False, eligible=True))
        chooser.record(picks[-1], [0.5, 0.4, 9.0] if picks[-1] else [1.0, 1.0, 0.1])
    assert picks == [False, True, False, True] and chooser.decided is True
    assert chooser.pick(blocks, first_stage=False, eligible=True) is True
    assert chooser.pick(blocks, first_stage=False, eligible=False) is False
    assert chooser.pick(range(4, 6), first_stage=False, eligible=True) is False  # moved blocks: measured anew
    assert chooser.decided is None


def test_the_chooser_keeps_one_pass_unless_deferring_sends_clearly_sooner() -> None:
    chooser = DeferralChooser()  # 3 trials each way, at least 5% sooner
    for _ in range(6):
        defer = chooser.pick(range(2), first_stage=False, eligible=True)
        chooser.record(defer, [0.97] if defer else [1.0])
    assert chooser.decided is False and chooser.pick(range(2), False, True) is False


def test_a_forced_chooser_ignores_measurements_but_never_defers_on_the_first_stage() -> None:
    assert DeferralChooser(forced=True).pick(range(2), first_stage=False, eligible=False) is True
    assert DeferralChooser(forced=True).pick(range(2), first_stage=True, eligible=True) is False
    assert DeferralChooser(forced=False).pick(range(2), first_stage=False, eligible=True) is False


def test_serialised_counts_consecutive_pairs_sharing_upstream() -> None:
    stem, a, b = (0, -1), (1, 0), (1, 1)
    every = [[frozenset({stem}), frozenset({a})]] * 4
    assert serialised(every, 4, stage=1)
    assert not serialised(every, 4, stage=0)  # nothing upstream of the first stage
    distinct = [[frozenset({(0, k)}), frozenset()] for k in range(4)]
    assert not serialised(distinct, 4, stage=1)
    half = [[frozenset({a})], [frozenset({a})], [frozenset({b})], [frozenset({(9, 9)})], [frozenset({(9, 9)})]]
    assert serialised([[r[0], frozenset()] for r in half], 5, stage=1)  # 2 of 4 pairs
    assert not serialised(every, 1, stage=1)  # no pair


class HookedIntermediate(nn.Module):
    """Registers a gradient hook on an intermediate tensor whose node is an intersection."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(self.halve)
        return torch.tanh(self.b(torch.tanh(h)))

    def halve(self, grad: Tensor) -> Tensor:
        self.calls += 1
        return grad * 0.5


def test_a_tensor_hook_in_a_block_changes_the_gradients_once() -> None:
    torch.manual_seed(3)
    blocks: list[nn.Module] = [HookedIntermediate(), HookedIntermediate()]
    compare(blocks, torch.randn(3, 4, requires_grad=True), (torch.randn(3, 4),))
    assert [b.calls for b in blocks] == [2, 2]  # called again in the weight pass, its result unused there


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_defers_or_takes_one_pass(reentrant: bool) -> None:
    """Non-reentrant checkpointing splits like any graph; the reentrant kind is a custom autograd.Function,
    which the input pass cannot run (``autograd.grad`` is refused), so its block takes one pass."""
    torch.manual_seed(4)
    compare([Checkpointed(reentrant), Checkpointed(reentrant)], torch.randn(3, 4, requires_grad=True),
            (torch.randn(3, 4),), expect_deferred=not reentrant)
