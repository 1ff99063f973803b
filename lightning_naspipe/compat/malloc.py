"""glibc's malloc, set to keep freed memory for reuse while NASPipe times modules on the CPU.

With glibc's defaults, a block whose activations take megabytes (a CNN's expanded channels) gets them from fresh
pages on every run: an allocation over the mmap threshold is mapped anew, and a freed heap top over the trim
threshold is returned to the system, so each run page-faults the memory in again (27,000 faults, ~100 MB zeroed,
per run of one MobileNet block at batch 32). That cost depends on which allocations came before, so a block timed
alone and the same block inside its whole subnet differ: MobileNet-style tables predicted their smallest subnets
30-40% slow, and two tables of one space 58% apart. :func:`keep_freed_memory` raises both thresholds once per
process (``mallopt``), as PyTorch's CPU tuning guide advises a caching allocator (jemalloc, tcmalloc) for:
runs then reuse their memory (no faults), timings are steady and what a tuned CPU deployment sees.

Left alone: where the C library is not glibc, where the environment sets glibc's own ``MALLOC_*`` variables or
preloads another allocator (``LD_PRELOAD``), and when ``LIGHTNING_NASPIPE_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

#: The environment variable that leaves glibc's defaults when set to ``default``.
ENV = "LIGHTNING_NASPIPE_MALLOC"
#: Allocations up to this size come from the heap: glibc's largest mmap threshold on 64-bit (32 MiB).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top kept up to this size instead of returned to the system.
TRIM_THRESHOLD = 1 << 30
# glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_USERS_OWN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
              "GLIBC_TUNABLES")

_kept: bool | None = None  # decided once per process


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (see the module's docstring), once per process; whether it
    is set. Raising the thresholds also turns off glibc's own adjustment of them, for the rest of the process: the
    process keeps up to :data:`TRIM_THRESHOLD` of freed memory instead of returning it."""
    global _kept
    if _kept is None:
        _kept = _applies() and _set(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _set(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return _kept


def _applies() -> bool:
    """Whether this process uses glibc's malloc with its defaults and the user has not opted out."""
    if os.environ.get(ENV, "").strip().lower() == "default" or any(name in os.environ for name in _USERS_OWN):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _set(option: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(None).mallopt(option, value))
    except (OSError, AttributeError):
        return False
