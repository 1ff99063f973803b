import os

import pytest

from lightning_naspipe.integration.affinity import core_share, pin_process


def test_core_share_gives_disjoint_equal_slices():
    cores = [5, 1, 3, 7, 0, 2]
    shares = [core_share(cores, r, 3, 1) for r in range(3)]
    assert shares == [[0, 1], [2, 3], [5, 7]]


@pytest.mark.parametrize("processes, threads", [(1, 1), (3, 1), (2, 2)])
def test_core_share_leaves_affinity_alone_without_enough_cores(processes, threads):
    assert core_share([0, 1], 0, processes, threads) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_pins_and_restores():
    before = os.sched_getaffinity(0)
    one = min(before)
    assert pin_process([one]) == before
    assert os.sched_getaffinity(0) == {one}
    pin_process(sorted(before))
    assert os.sched_getaffinity(0) == before
