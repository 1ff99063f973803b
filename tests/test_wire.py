"""The one-message wire format, in process: packing, unpacking and size announcements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_naspipe.wire import ALIGN, DTYPES, FIRST_SIZE, flatten, pack, resize_message, resized, unpack

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
@given(values, st.booleans())
def test_any_value_round_trips_bit_for_bit(specs: list, as_tuple: bool) -> None:
    tensors = [_tensor(dtype, shape, seed) for dtype, shape, seed in specs]
    value = tuple(tensors) if as_tuple or len(tensors) > 1 else tensors[0]
    message = pack(value, CPU)
    assert message.dtype == torch.uint8 and message.numel() % ALIGN == 0
    assert resized(message) is None
    got = unpack(message, requires_grad=True)
    got_tensors, got_tuple = flatten(got)
    assert got_tuple == isinstance(value, tuple)
    for a, b in zip(got_tensors, tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b)
        assert a.requires_grad == b.is_floating_point()


def test_received_activations_are_leaves_that_collect_gradients() -> None:
    x = torch.randn(3, 5)
    received = unpack(pack((x, x.long()), CPU), requires_grad=True)
    received[0].pow(2).sum().backward()
    assert torch.equal(received[0].grad, 2 * x)
    assert not received[1].requires_grad


def test_non_contiguous_and_grad_tensors_are_sent_by_value() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    y = (x * 2).t()  # non-contiguous, part of a graph
    got = unpack(pack(y, CPU), requires_grad=False)
    assert torch.equal(got, y.detach()) and not got.requires_grad


def test_size_announcement_fits_the_expected_size() -> None:
    message = resize_message(48, 1024, CPU)
    assert message.numel() == 48 and resized(message) == 1024
    assert resized(resize_message(FIRST_SIZE, 7, CPU)) == 7


def test_non_tensor_boundary_values_are_refused() -> None:
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        pack({"x": torch.ones(1)}, CPU)
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        flatten(())
