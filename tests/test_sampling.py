from __future__ import annotations

import collections

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_naspipe.pipeline.sampling.keyed import keyed_rng, mix, uniform_architecture


def test_mix_is_a_stable_function() -> None:
    # Fixed values: any change here would silently change every user's subnets.
    assert mix(0) == 16294208416658607535
    assert mix(1, 2, 3) == mix(1, 2, 3) != mix(3, 2, 1)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**63), index=st.integers(0, 2**40))
def test_architecture_is_a_pure_function_in_range(seed: int, index: int) -> None:
    labels = {"a": 3, "b": 1, "c": 97}
    arch = uniform_architecture(labels, seed, index)
    assert arch == uniform_architecture(dict(labels), seed, index)
    assert all(0 <= arch[label] < count for label, count in labels.items())


def test_sampler_is_roughly_uniform_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    counts = collections.Counter(uniform_architecture({"a": 4}, 5, i)["a"] for i in range(4000))
    assert torch.equal(before, torch.get_rng_state())
    assert all(900 < counts[k] < 1100 for k in range(4))


def test_keyed_rng_depends_on_key_only_and_restores_state() -> None:
    torch.manual_seed(0)
    with keyed_rng(torch.device("cpu"), 1, 2, 3):
        a = torch.rand(4)
    torch.rand(10)  # consuming the global RNG in between changes nothing
    with keyed_rng(torch.device("cpu"), 1, 2, 3):
        b = torch.rand(4)
    with keyed_rng(torch.device("cpu"), 1, 2, 4):
        c = torch.rand(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with keyed_rng(torch.device("cpu"), 9):
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected)
