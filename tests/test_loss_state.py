"""loss_state: compute_loss changing the module's state outside the supernet is refused on several processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from inprocess import train_pipelined
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.exactness.loss_state import OutsideState, outside_state
from test_engine import FakeModule, batches, make_supernet


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.register_buffer("seen", torch.zeros(()))
        self.count = 0
        self.name = "a"
        self.total = torch.zeros(())
        self.history: list[int] = []


def test_nothing_changed_is_nothing_and_the_supernet_is_not_watched() -> None:
    module = Holder()
    watch = OutsideState(module, module.supernet)
    assert [name for name, _ in watch.buffers] == ["seen"]  # BatchNorm's statistics are the supernet's
    before = watch.snapshot()
    next(m for m in module.supernet.modules() if isinstance(m, nn.BatchNorm1d)).running_mean.add_(1)  # type: ignore[union-attr]
    module.history.append(1)  # a container changed in place is not seen (documented)
    module._private = 3  # noqa: SLF001  (underscore names are the framework's)
    assert watch.changed(before) == []
    watch.refuse_changes(before)


@pytest.mark.parametrize("change", ["count", "name", "total", "seen_inplace", "seen_replaced", "new"])
def test_each_kind_of_change_is_named(change: str) -> None:
    module = Holder()
    watch = OutsideState(module, module.supernet)
    before = watch.snapshot()
    if change == "count":
        module.count += 1
    elif change == "name":
        module.name = "b"
    elif change == "total":
        module.total = module.total + 1
    elif change == "seen_inplace":
        module.seen += 1
    elif change == "seen_replaced":
        module.seen = torch.ones(())
    else:
        module.added = 1.0
    expected = {"seen_inplace": "seen", "seen_replaced": "seen", "new": "added"}.get(change, change)
    assert watch.changed(before) == [expected]
    with pytest.raises(lnp.NASPipeConfigError, match=f"compute_loss changed {expected} of Holder.*on_train_subnet_end"):
        watch.refuse_changes(before)


def test_the_watch_is_made_once_per_module() -> None:
    module = Holder()
    assert outside_state(module) is outside_state(module)


class CountingModule(FakeModule):
    def __init__(self, supernet: lnp.Supernet) -> None:
        super().__init__(supernet)
        self.samples_seen = 0

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        self.samples_seen += len(batch[1])
        return super().compute_loss(output, batch)


def test_two_stages_refuse_a_counter_in_compute_loss_and_one_process_keeps_it() -> None:
    module = CountingModule(make_supernet())
    with pytest.raises(lnp.NASPipeConfigError, match="compute_loss changed samples_seen of CountingModule"):
        train_pipelined(module, [range(0, 2), range(2, 5)], batches(4), 2)  # type: ignore[arg-type]
    alone = CountingModule(make_supernet())
    Engine([range(5)]).train_window(alone, batches(3), 0)  # type: ignore[arg-type]
    assert alone.samples_seen == 18  # the plain Trainer's engine: exact on one process, nothing refused
