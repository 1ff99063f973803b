"""Counter-based randomness: every value is a pure function of (seed, counters).

Subnet ``i`` is ``f(seed, i)`` and a block's dropout masks are drawn from a generator seeded by
``(seed, subnet, block, chunk)``. Every stage process evaluates these locally, and no value
depends on how many draws happened before, so the result does not depend on the partition into
stages, on the window, or on where a run was resumed. The global torch RNG is never consumed; nor are
Python's and NumPy's global generators, keyed alike inside (:mod:`.host_rng`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from lightning_naspipe.pipeline.sampling.host_rng import restore_host_generators, seed_host_generators

_MASK64 = (1 << 64) - 1
# Domain tags keep the streams for sampling and for dropout independent of each other.
SAMPLER_DOMAIN = 0x5A3D
DROPOUT_DOMAIN = 0xD209
EVAL_DOMAIN = 0xE7A1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(*values: int) -> int:
    """Hash integers to a well-spread unsigned 64-bit value (stable across processes and runs)."""
    state = 0
    for value in values:
        state = _splitmix64(state ^ (int(value) & _MASK64))
    return state


def uniform_architecture(labels: Mapping[str, int], seed: int, index: int) -> dict[str, int]:
    """Subnet ``index``: a uniform candidate per label, drawn from ``(seed, index)`` alone.

    Args:
        labels: label -> candidate count, in a fixed order.
        seed: the run's seed.
        index: the subnet's position in training order (its global step).
    """
    return {
        label: mix(SAMPLER_DOMAIN, seed, index, position) % count
        for position, (label, count) in enumerate(labels.items())
    }


@contextlib.contextmanager
def keyed_rng(device: torch.device, *key: int) -> Iterator[None]:
    """Run the body with torch's RNG for ``device`` seeded from ``key``; restore it afterwards.

    Only the generator of ``device`` (and the CPU one) is forked, so code that draws from the
    global RNG inside (``nn.Dropout``, ``torch.rand``) gets draws that depend on ``key`` only; so do
    Python's ``random`` and NumPy's global generator (:mod:`.host_rng`).
    """
    seed = mix(DROPOUT_DOMAIN, *key) & ((1 << 63) - 1)
    host = seed_host_generators(seed)
    try:
        if device.type == "cuda":
            with torch.random.fork_rng(devices=[device], device_type="cuda"):
                torch.default_generator.manual_seed(seed)
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
                yield
        else:  # what fork_rng(devices=[]) does, without its per-call overhead (this runs once per block and pass)
            state = torch.get_rng_state()
            torch.default_generator.manual_seed(seed)
            try:
                yield
            finally:
                torch.set_rng_state(state)
    finally:
        restore_host_generators(host)
