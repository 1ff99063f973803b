"""The private CPython and NumPy names NASPipe reaches: the global generators behind ``random.random()`` and
``np.random.rand()``, saved and restored as raw bytes (~1 us where ``getstate``/``setstate`` take 15-85 us).

Guarded in ``tests/test_private_apis.py::test_host_generator_internals`` (docs/design.md's table).
"""

from __future__ import annotations

import ctypes
import random
import sys
from typing import Any

__all__ = ["RAW_PYTHON_STATE", "numpy_state", "numpy_state_address", "python_generator", "python_state",
           "set_numpy_state", "set_python_state"]

_MT19937_BYTES = 624 * 4 + 4  # numpy/random/src/mt19937/mt19937.h: uint32_t key[624]; int pos
# CPython's Modules/_randommodule.c: RandomObject is PyObject_HEAD, int index, uint32_t state[624]. Copying those
# bytes takes ~1 us where getstate/setstate build and parse a 625-int tuple (~15 us); checked before use.
_PY_OFFSET, _PY_BYTES = object.__basicsize__, 4 + 624 * 4


def _raw_python_state_works() -> bool:
    """Whether Python's generators keep their state where ``_PY_OFFSET`` says (checked on two throwaway ones)."""
    import _random

    if sys.implementation.name != "cpython" or _random.Random.__basicsize__ < _PY_OFFSET + _PY_BYTES:
        return False
    source, target = random.Random(1), random.Random(2)
    saved = ctypes.string_at(id(source) + _PY_OFFSET, _PY_BYTES)
    expected = [source.random() for _ in range(700)]  # past a regeneration of the 624 words
    ctypes.memmove(id(target) + _PY_OFFSET, saved, _PY_BYTES)
    return [target.random() for _ in range(700)] == expected


#: Whether :func:`python_state` copies raw bytes (else ``getstate``'s tuple).
RAW_PYTHON_STATE = _raw_python_state_works()


def python_generator() -> Any:
    """``random._inst``: the generator ``random.random()`` and the module's other functions draw from."""
    return random._inst


def python_state(python: Any) -> Any:
    """``python``'s state, for :func:`set_python_state`."""
    return ctypes.string_at(id(python) + _PY_OFFSET, _PY_BYTES) if RAW_PYTHON_STATE else python.getstate()


def set_python_state(python: Any, state: Any, gauss_next: Any) -> None:
    """Put back ``state`` (:func:`python_state`) and the cached Gaussian ``gauss_next`` read with it."""
    if RAW_PYTHON_STATE:
        ctypes.memmove(id(python) + _PY_OFFSET, state, _PY_BYTES)
        python.gauss_next = gauss_next
    else:
        python.setstate(state)


def numpy_state_address() -> int | None:
    """Where NumPy's global MT19937 keeps its state; ``None`` while NumPy is not imported (nothing can draw)."""
    numpy: Any = sys.modules.get("numpy")
    if numpy is None:
        return None
    bit_generator = numpy.random.mtrand._rand._bit_generator
    return int(bit_generator.ctypes.state_address)


def numpy_state(address: int) -> bytes:
    """The raw MT19937 state at ``address`` (:func:`numpy_state_address`)."""
    return ctypes.string_at(address, _MT19937_BYTES)


def set_numpy_state(address: int, state: bytes) -> None:
    """Put back the raw state :func:`numpy_state` read."""
    ctypes.memmove(address, state, _MT19937_BYTES)
