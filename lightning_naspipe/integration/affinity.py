"""Pinning CPU stage processes to their own cores.

On CPU, every stage process has a compute thread plus the process group's communication threads.
Left to the scheduler, a thread woken by a message often lands on the core where the other stage
computes and preempts it; with each process pinned to its own equal share of the cores, the
threads of one stage only ever compete with each other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["core_share", "pin_process"]


def core_share(cores: Sequence[int], local_rank: int, local_processes: int, threads: int) -> list[int] | None:
    """The cores local process ``local_rank`` of ``local_processes`` gets: an equal, disjoint slice of
    ``cores`` (sorted). ``None`` when each process could not get ``threads`` cores of its own."""
    share = len(cores) // max(local_processes, 1)
    if local_processes < 2 or share < max(threads, 1) or not 0 <= local_rank < local_processes:
        return None
    ordered = sorted(cores)
    return ordered[local_rank * share:(local_rank + 1) * share]


def pin_process(cores: Sequence[int]) -> set[int]:
    """Pin every thread of this process (and those it starts later) to ``cores``; the affinity before."""
    before = os.sched_getaffinity(0)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, set(cores))
        except OSError:  # a thread that ended meanwhile
            pass
    return before


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]
