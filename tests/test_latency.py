"""The latency lookup table: measured in place, predictions are sums of entries, saved and loaded, and a latency
budget in lnp.search (an impossible one refused before any evaluation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.sampling import uniform_architecture


def _supernet() -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(nn.Linear(4, 8), lnp.ChoiceBlock([nn.Identity(), nn.Linear(8, 8), nn.Sequential(
        nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8))], label="a"),
        lnp.ChoiceBlock([nn.Tanh(), nn.Linear(8, 8)], label="b"), nn.Linear(8, 3))


class _Net(lnp.NASPipeMixin, torch.nn.Module):
    """Enough of a NASPipe module for lnp.search without a Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.supernet = _supernet()

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])


def test_a_prediction_is_the_sum_of_its_blocks_entries_and_the_table_round_trips(tmp_path: Path) -> None:
    supernet = _supernet()
    table = lnp.LatencyTable.measure(supernet, torch.randn(16, 4), repeats=3)
    assert table.labels == (None, "a", "b", None) and [len(row) for row in table.entries] == [1, 3, 2, 1]
    assert table.batch_size == 16 and table.device == "cpu" and all(t > 0 for row in table.entries for t in row)
    for i in range(6):
        arch = uniform_architecture(supernet.labels, 0, i)
        expected = table.entries[0][0] + table.entries[1][arch["a"]] + table.entries[2][arch["b"]] + table.entries[3][0]
        assert table.predict(arch) == expected
    assert table.fastest_ms() == sum(min(row) for row in table.entries)
    assert lnp.LatencyTable.load(table.save(tmp_path / "table.json")) == table


def test_a_latency_budget_filters_the_search_and_an_impossible_one_is_refused_before_evaluating() -> None:
    model = _Net()
    table = lnp.LatencyTable(((1.0,), (0.5, 2.0, 9.0), (0.25, 1.0), (1.0,)), (None, "a", "b", None), "cpu", 8)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    result = lnp.search(None, model, lnp.GridSearch(), data, latency=table, max_latency_ms=4.0)
    assert result.history and all(table.predict(r.architecture) <= 4.0 for r in result.history)
    assert {tuple(sorted(r.architecture.items())) for r in result.history} == {
        (("a", a), ("b", b)) for a in range(3) for b in range(2) if table.predict({"a": a, "b": b}) <= 4.0}
    with pytest.raises(lnp.NASPipeConfigError, match=r"max_latency_ms=2.5\): no architecture can meet it: the "
                                                     r"fastest predicted is 2\.750 ms"):
        lnp.search(None, model, lnp.GridSearch(), data, latency=table, max_latency_ms=2.5)
    with pytest.raises(lnp.NASPipeConfigError, match="needs latency="):
        lnp.search(None, model, lnp.GridSearch(), data, max_latency_ms=2.5)
    other = lnp.LatencyTable(((1.0,), (0.5, 2.0)), (None, "a"), "cpu", 8)
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        lnp.search(None, model, lnp.GridSearch(), data, latency=other, max_latency_ms=9.0)
