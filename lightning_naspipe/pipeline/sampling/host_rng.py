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
import sys
from collections.abc import Iterator
from typing import Any

from lightning_naspipe.compat.python import (numpy_state, numpy_state_address, python_generator, python_state,
                                            set_numpy_state, set_python_state)

#: What :func:`seed_host_generators` saved: Python's state and cached Gaussian, NumPy's state address and bytes.
Saved = tuple[Any, Any, "int | None", bytes]


def seed_host_generators(seed: int) -> Saved:
    """Seed Python's ``random`` and NumPy's global generator from ``seed``; what :func:`restore_host_generators`
    needs to put them back (a pair of calls, not a context manager: this runs once per block and micro-batch)."""
    python = python_generator()  # what random.random() and the module's other functions draw from
    saved: Saved = (python_state(python), python.gauss_next, address := numpy_state_address(),
                    numpy_state(address) if address is not None else b"")
    python.seed(seed)
    if address is not None:
        sys.modules["numpy"].random.seed(seed & 0xFFFFFFFF)
    return saved


def restore_host_generators(saved: Saved) -> None:
    """Put back what :func:`seed_host_generators` saved."""
    state, gauss_next, address, raw = saved
    set_python_state(python_generator(), state, gauss_next)
    if address is not None:
        sys.modules["numpy"].random.seed(0)  # clears a Gaussian the body left cached (the state is put back next)
        set_numpy_state(address, raw)


@contextlib.contextmanager
def keyed_host_generators(seed: int) -> Iterator[None]:
    """Run the body with Python's ``random`` and NumPy's global generator seeded from ``seed``; restore both."""
    saved = seed_host_generators(seed)
    try:
        yield
    finally:
        restore_host_generators(saved)
