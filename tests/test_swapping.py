"""SwappedResource and AsyncCopier: the pointer switching and copying under offloading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_naspipe.space.supernet import ResourceState
from lightning_naspipe.pipeline.offload.swapping import AsyncCopier, SwappedResource


class _TiedBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("scale", torch.arange(2.0))
        self.twin = nn.Module()
        self.twin.register_buffer("scale", self.scale)  # the same tensor in two slots


def _resource(module: nn.Module) -> SwappedResource:
    state = ResourceState(tuple(module.parameters()),
                          tuple((m, n) for m in module.modules() for n in m._buffers))
    return SwappedResource.of(state)


def test_switching_copies_keeps_tied_buffers_one_tensor_and_values_exact() -> None:
    module = _TiedBuffers()
    optimizer = torch.optim.Adam(module.parameters())
    module.linear(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    before = [t.clone() for t in _resource(module).tensors(optimizer)]
    resource = _resource(module)
    assert len(resource.buffers) == 1 and len(resource.buffers[0]) == 2
    resource.move_to_host(optimizer, pin=False)
    copier = AsyncCopier(torch.device("cpu"))
    try:
        targets, ready = copier.start(resource.tensors(optimizer))
        copier.wait(ready)
        resource.point_to(targets, optimizer)
        assert module.linear.weight.data.data_ptr() == targets[0].data_ptr()
        assert module.scale is module.twin.scale  # tied slots follow together
        assert optimizer.state[module.linear.weight]["exp_avg"].data_ptr() in {t.data_ptr() for t in targets}
        with torch.no_grad():
            module.linear.weight.add_(1.0)  # an update while resident
        resource.write_back(optimizer, pin=False)
        assert module.linear.weight.data.data_ptr() == resource.host[0].data_ptr()
        assert torch.equal(module.linear.weight, before[0] + 1.0)
        assert all(torch.equal(a, b) for a, b in zip(resource.tensors(optimizer)[1:], before[1:]))
    finally:
        copier.close()


def test_write_back_lists_optimizer_state_created_while_resident() -> None:
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    resource = _resource(module)
    resource.move_to_host(optimizer, pin=False)
    assert len(resource.host) == 2  # no momentum yet
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # creates momentum buffers
    resource.write_back(optimizer, pin=False)
    assert len(resource.host) == 4
    assert optimizer.state[module.weight]["momentum_buffer"].data_ptr() == resource.host[2].data_ptr()


def test_a_closed_copier_says_so() -> None:
    copier = AsyncCopier(torch.device("cpu"))
    copier.close()
    with pytest.raises(RuntimeError, match="closed"):
        copier.start([torch.zeros(2)])
