"""The one-message wire format, in process: packing, unpacking and size announcements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_naspipe.space.boundary import cut, tensors_in
from lightning_naspipe.transport.wire import ALIGN, DTYPES, FIRST_SIZE, pack, resize_message, resized, unpack

CPU = torch.device("cpu")


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(values.float(), -values.float()).to(dtype)
    return values.to(dtype)


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
values = st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 10**6)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(values, st.booleans(), st.booleans())
def test_any_value_round_trips_bit_for_bit(specs: list, as_tuple: bool, grad: bool) -> None:
    tensors = [_tensor(dtype, shape, seed) for dtype, shape, seed in specs]
    tensors = [t.requires_grad_(grad and t.is_floating_point()) for t in tensors]
    value = tuple(tensors) if as_tuple or len(tensors) > 1 else tensors[0]
    message = pack(value, CPU)
    assert message.dtype == torch.uint8 and message.numel() % ALIGN == 0
    assert resized(message) is None
    got = unpack(message)
    assert isinstance(got, tuple) == isinstance(value, tuple)
    for a, b in zip(tensors_in(got), tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
        assert a.requires_grad == b.requires_grad and a.is_leaf


def test_received_activations_are_leaves_that_collect_gradients() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    received = unpack(pack((x * 1, x.long()), CPU))
    received[0].pow(2).sum().backward()
    assert torch.equal(received[0].grad, 2 * x.detach())
    assert not received[1].requires_grad


def test_non_contiguous_and_grad_tensors_are_sent_by_value() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    y = (x * 2).t()  # non-contiguous, part of a graph
    got = unpack(pack(y, CPU))
    assert torch.equal(got, y.detach()) and got.requires_grad and got.is_contiguous()


def test_channels_last_keeps_its_layout() -> None:
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    got = unpack(pack(x, CPU))
    assert torch.equal(got, x) and got.stride() == x.stride() == cut(x).stride()


def test_size_announcement_fits_the_expected_size() -> None:
    message = resize_message(48, 1024, CPU)
    assert message.numel() == 48 and resized(message) == 1024
    assert resized(resize_message(FIRST_SIZE, 7, CPU)) == 7


def test_any_structure_round_trips_as_cut_gives_it() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    value = {"h": (x * 2, x * 2), "depth": 3, "skip": None, "rest": [torch.arange(4), "tag"]}
    got = unpack(pack(value, CPU))
    local = cut(value)
    assert got.keys() == value.keys() and got["depth"] == 3 and got["skip"] is None and got["rest"][1] == "tag"
    for a, b in zip(tensors_in(got), tensors_in(local), strict=True):
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad and a.stride() == b.stride()


def test_gradient_tuples_carry_none_and_empty() -> None:
    g = torch.randn(3)
    got = unpack(pack((None, g, None), CPU))
    assert got[0] is None and got[2] is None and torch.equal(got[1], g)
    assert unpack(pack((), CPU)) == ()


def test_unpicklable_boundary_values_are_refused() -> None:
    with pytest.raises(TypeError, match="cannot be sent"):
        pack({"f": lambda: 0}, CPU)
