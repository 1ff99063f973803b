"""Engines of stages x replicas in one process (tests/inprocess_grid.py: a thread per process, a module copy each)
against the one-device engine, bit for bit: losses, and every stage's weights and buffers on every replica."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from inprocess_grid import assert_grid_equals, train_grid
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from test_engine import FakeModule

SEED = 5


class _Module(FakeModule):
    """test_engine.py's stand-in with ``subnets`` per training step; ``teacher``: in-place distillation
    (``compute_loss(..., teacher=...)``); ``logits``: the last block's output to logits (it may be a tuple)."""

    naspipe_seed = SEED

    def __init__(self, supernet: lnp.Supernet, subnets: int, teacher: bool,
                 logits: Callable[[Any], torch.Tensor]) -> None:
        super().__init__(supernet)
        self.subnets, self.logits = subnets, logits
        self.optimizer = torch.optim.Adam(supernet.parameters(), lr=0.05)
        if teacher:
            self.compute_loss = self._distilling  # type: ignore[method-assign]

    def sample_step(self, step: int) -> list[dict[str, int]]:
        return [uniform_architecture(self.supernet.labels, SEED, step * self.subnets + j) for j in range(self.subnets)]

    def sample_subnet(self, index: int) -> dict[str, int]:
        return self.sample_step(index)[0]

    def compute_loss(self, output: Any, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(self.logits(output), batch[1])

    def _distilling(self, output: Any, batch: Any, teacher: Any = None) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.logits(output), batch[1])
        return loss if teacher is None else loss + nn.functional.mse_loss(self.logits(output), self.logits(teacher))


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g) * 2 + 1, torch.randint(0, 3, (8,), generator=g)) for _ in range(count)]


def _assert_one_device(make: Callable[[], lnp.Supernet], stage_blocks: list[range], replicas: int, chunks: int,
                       subnets: int = 1, teacher: bool = False, logits: Callable[[Any], torch.Tensor] = lambda y: y,
                       **engine_kwargs: Any) -> None:
    batches, window = _batches(6), 3
    reference = _Module(make(), subnets, teacher, logits)
    engine = Engine([range(len(reference.supernet))], chunks=chunks)
    losses = [loss for start in range(0, len(batches), window)
              for loss in engine.train_window(reference, batches[start:start + window], start).losses]
    grid = [[_Module(make(), subnets, teacher, logits) for _ in range(replicas)] for _ in stage_blocks]
    found = train_grid(grid, stage_blocks, batches, window, chunks, **engine_kwargs)
    expected = reference.supernet.state_dict()
    assert_grid_equals(losses, expected, found, grid, stage_blocks)  # type: ignore[arg-type]


def _two_blocks_read_one_weight() -> lnp.Supernet:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    return lnp.Supernet(nn.Linear(5, 8), lnp.ChoiceBlock([nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.ReLU()]),
                        nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh()), nn.Linear(8, 3))


def test_deferred_weight_gradients_of_a_weight_two_blocks_read_are_two_addends_on_a_later_replica() -> None:
    """Deferred, the blocks' weight passes run after the last block's input pass; a later replica must still take
    each block's accumulation as an addend of its own (``(prefix + a) + b``, not ``prefix + (a + b)``)."""
    _assert_one_device(_two_blocks_read_one_weight, [range(0, 2), range(2, 5)], replicas=2, chunks=2,
                       defer_weight_grads=True)


class _TupleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        y = self.linear(x)
        return y, {"twice": y * 2, "note": None}


def _batch_norms(momentum: float | None) -> Callable[[], lnp.Supernet]:
    """BatchNorm in candidates, one layer reused by two blocks and twice in one candidate, elastic BatchNorm, a
    candidate with no parameters, and a tuple output (a teacher of several tensors)."""
    def make() -> lnp.Supernet:
        torch.manual_seed(0)
        widths, reused = [3, 5, 8], nn.BatchNorm1d(8, momentum=momentum)
        return lnp.Supernet(
            lnp.ElasticLinear(5, widths, label="w"),
            nn.Sequential(lnp.ElasticBatchNorm1d(widths, label="w", momentum=momentum), nn.Tanh()),
            lnp.ElasticLinear(widths, 8, in_label="w"),
            lnp.ChoiceBlock([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum)), nn.Identity(),
                             nn.Sequential(reused, nn.Tanh(), reused)], label="a"),
            lnp.ChoiceBlock([nn.Sequential(reused, nn.ReLU()), nn.Tanh()], label="b"),
            _TupleHead())
    return make


@pytest.mark.parametrize(("stages", "replicas", "chunks", "subnets"), [
    (1, 2, 1, 2), (2, 2, 2, 3), (2, 4, 4, 3), (3, 3, 1, 3), (3, 4, 2, 2)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_stages_x_replicas_with_batch_norms_and_teachers_equal_one_device(stages: int, replicas: int, chunks: int,
                                                                          subnets: int, momentum: float | None) -> None:
    """Shares that start inside a subnet's pieces (2 x 3 on 2 replicas), replicas training different subnets of a
    step, 3 and 4 replicas, lookahead; each subnet after a step's first learns from its output on the same piece."""
    ranges = {1: [range(0, 6)], 2: [range(0, 3), range(3, 6)], 3: [range(0, 2), range(2, 3), range(3, 6)]}[stages]
    _assert_one_device(_batch_norms(momentum), ranges, replicas, chunks, subnets, teacher=True,
                       logits=lambda y: y[0] + y[1]["twice"], lookahead=True)
