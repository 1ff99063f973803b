"""Python's and NumPy's global random generators, keyed like torch's inside blocks and ``compute_loss``.

A block that draws stochastic depth with ``random.random()`` or noise with ``np.random.rand()`` would otherwise
get draws that depend on what ran before it in its process: on one device every block and every subnet, on a
stage only its own blocks, on a replica only its share of the micro-batches. :func:`keyed_host_generators` seeds
both from the key for the body and restores them afterwards, so code outside (a dataset's augmentation, a sampler)
sees its own stream untouched, as torch's global generator is (:func:`~.sampling.keyed_rng`).

NumPy's legacy global generator (``np.random.seed``, ``np.random.rand``, ...) is an MT19937 whose state is
saved and restored as its raw 2.5 KB (``get_state``/``set_state`` build Python objects and cost ~50x more: this
runs once per block and micro-batch). Its cached second Gaussian (legacy ``randn`` draws normals in pairs) is
cleared on entry and on exit, not restored: only code outside blocks that draws an odd number of legacy normals
between two batches would see another value. Generators the user creates (``np.random.default_rng(...)``,
``random.Random(...)``) are the user's to seed.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import sys
from collections.abc import Iterator
from typing import Any

_MT19937_BYTES = 624 * 4 + 4  # numpy/random/src/mt19937/mt19937.h: uint32_t key[624]; int pos
# CPython's Modules/_randommodule.c: RandomObject is PyObject_HEAD, int index, uint32_t state[624]. Copying those
# bytes takes ~1 us where getstate/setstate build and parse a 625-int tuple (~15 us); checked before use.
_PY_OFFSET, _PY_BYTES = object.__basicsize__, 4 + 624 * 4


def _raw_python_state_works() -> bool:
    """Whether Python's generators keep their state where :data:`_PY_OFFSET` says (checked on two throwaway ones)."""
    import _random

    if sys.implementation.name != "cpython" or _random.Random.__basicsize__ < _PY_OFFSET + _PY_BYTES:
        return False
    source, target = random.Random(1), random.Random(2)
    saved = ctypes.string_at(id(source) + _PY_OFFSET, _PY_BYTES)
    expected = [source.random() for _ in range(700)]  # past a regeneration of the 624 words
    ctypes.memmove(id(target) + _PY_OFFSET, saved, _PY_BYTES)
    return [target.random() for _ in range(700)] == expected


_RAW_PYTHON_STATE = _raw_python_state_works()


def _numpy_state_address() -> int | None:
    """Where NumPy's global MT19937 keeps its state; ``None`` while NumPy is not imported (nothing can draw)."""
    numpy: Any = sys.modules.get("numpy")
    if numpy is None:
        return None
    bit_generator = numpy.random.mtrand._rand._bit_generator
    return int(bit_generator.ctypes.state_address)


#: What :func:`seed_host_generators` saved: Python's state and cached Gaussian, NumPy's state address and bytes.
Saved = tuple[Any, Any, "int | None", bytes]


def seed_host_generators(seed: int) -> Saved:
    """Seed Python's ``random`` and NumPy's global generator from ``seed``; what :func:`restore_host_generators`
    needs to put them back (a pair of calls, not a context manager: this runs once per block and micro-batch)."""
    python: Any = random._inst  # what random.random() and the module's other functions draw from
    saved: Saved = (ctypes.string_at(id(python) + _PY_OFFSET, _PY_BYTES) if _RAW_PYTHON_STATE else python.getstate(),
                    python.gauss_next, address := _numpy_state_address(),
                    ctypes.string_at(address, _MT19937_BYTES) if address is not None else b"")
    python.seed(seed)
    if address is not None:
        sys.modules["numpy"].random.seed(seed & 0xFFFFFFFF)
    return saved


def restore_host_generators(saved: Saved) -> None:
    """Put back what :func:`seed_host_generators` saved."""
    python_state, gauss_next, address, numpy_state = saved
    python: Any = random._inst
    if _RAW_PYTHON_STATE:
        ctypes.memmove(id(python) + _PY_OFFSET, python_state, _PY_BYTES)
        python.gauss_next = gauss_next
    else:
        python.setstate(python_state)
    if address is not None:
        sys.modules["numpy"].random.seed(0)  # clears a Gaussian the body left cached (the state is put back next)
        ctypes.memmove(address, numpy_state, _MT19937_BYTES)


@contextlib.contextmanager
def keyed_host_generators(seed: int) -> Iterator[None]:
    """Run the body with Python's ``random`` and NumPy's global generator seeded from ``seed``; restore both."""
    saved = seed_host_generators(seed)
    try:
        yield
    finally:
        restore_host_generators(saved)
