"""Python's and NumPy's global generators inside a keyed region: draws depend on the key only, and the streams
outside are untouched (what makes random.random() in a block exact on any layout)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_naspipe.compat import python as compat_python
from lightning_naspipe.pipeline.sampling.host_rng import keyed_host_generators


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(np.random.randn())


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1), st.integers(0, 20))
def test_a_region_draws_from_its_key_alone_and_leaves_the_outer_streams_as_they_were(
        key: int, outer_seed: int, consumed: int) -> None:
    random.seed(outer_seed)
    np.random.seed(outer_seed)
    expected_outside = [_draws() for _ in range(3)]
    random.seed(outer_seed)
    np.random.seed(outer_seed)
    for _ in range(consumed):  # whatever ran before in this process
        random.random()
        np.random.rand()
    with keyed_host_generators(key):
        inside = [_draws() for _ in range(3)]
    with keyed_host_generators(key):
        assert [_draws() for _ in range(3)] == inside
    random.seed(outer_seed)
    np.random.seed(outer_seed)
    with keyed_host_generators(key):
        assert [_draws() for _ in range(3)] == inside  # the same, whatever came before
    assert [_draws() for _ in range(3)] == expected_outside[:3]


def test_the_raw_copy_of_pythons_state_is_used_here_and_the_tuple_path_gives_the_same_draws() -> None:
    assert compat_python.RAW_PYTHON_STATE  # CPython: the ~1 us copy, not getstate's tuple
    draws = {}
    for raw in (True, False):
        compat_python.RAW_PYTHON_STATE = raw
        try:
            random.seed(3)
            with keyed_host_generators(9):
                inside = _draws()
            draws[raw] = (inside, random.random(), random.gauss(0, 1), random.gauss(0, 1))
        finally:
            compat_python.RAW_PYTHON_STATE = True
    assert draws[True] == draws[False]
    random.seed(3)
    assert draws[True][1:] == (random.random(), random.gauss(0, 1), random.gauss(0, 1))


def test_other_keys_draw_other_values() -> None:
    with keyed_host_generators(1):
        one = _draws()
    with keyed_host_generators(2):
        assert _draws() != one
