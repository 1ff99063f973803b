"""Rank 0's handling of the stage processes it launched (no process group needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_naspipe.namespaces import installed
from lightning_naspipe.integration import processes as processes_module
from lightning_naspipe.integration.processes import StageProcesses, delay_observer_kill, reap, wait_for_exit
from lightning_naspipe.transport.p2p import StageFailure


def _child(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_wait_for_exit_returns_the_children_still_running() -> None:
    quick, slow = _child(0.2), _child(30)
    try:
        assert wait_for_exit([quick, slow], grace_s=1.0) == [slow]
        assert quick.returncode == 0
    finally:
        slow.kill()
        slow.wait()


def test_reap_kills_what_outlives_the_grace() -> None:
    slow = _child(30)
    reap([slow], grace_s=0.2)
    assert slow.returncode is not None and slow.returncode < 0


class _Strategy:
    def on_exception(self, exception: BaseException) -> None:
        pass


class _Processes(StageProcesses, _Strategy):  # the mixin over a stand-in for Lightning's strategy
    pass


@pytest.mark.parametrize("error, waits", [(StageFailure("stage 2 failed"), True), (ValueError("own bug"), False)])
def test_rank_0_reports_a_lost_stage_after_its_children_exit(error: BaseException, waits: bool) -> None:
    # A stage lost to a failure elsewhere: the failing children print their errors first, so rank 0's
    # report is the last thing the user reads. Rank 0's own error is reported at once.
    processes = _Processes()
    child = _child(1.0)
    processes._children = [child]
    try:
        processes.on_exception(error)
        assert (child.poll() is not None) == waits  # it waited for the child to exit, or returned at once
    finally:
        reap([child], grace_s=0.0)


def test_receives_spin_only_on_cores_the_process_has_to_itself() -> None:
    processes = StageProcesses.__new__(StageProcesses)
    assert processes.receive_spin_s == 0.0  # not pinned: another stage may need the core
    processes._affinity_before = {0, 1}  # pinned to its own share of the cores
    assert processes.receive_spin_s > 0.0


class _Sleeps:
    """The module's clock: notes each sleep instead of sleeping."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.mark.parametrize("namespace", installed(), ids=lambda ns: ns.name)
def test_lightnings_process_observer_lets_rank_0_report_first(namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's popen launcher SIGKILLs the launching process (rank 0) and every stage within 5 s
    # of a stage failing, which hid rank 0's report of the failed stage; it must wait its grace first.
    observers = namespace.fabric_module("strategies.launchers.subprocess_script")
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed.wait()
    rank_0 = _child(30)  # stands in for the launching process
    observer = observers._ChildProcessObserver(main_pid=rank_0.pid, child_processes=[failed], sleep_period=3600)
    observer.start()  # asleep: the test runs its check below
    try:
        delay_observer_kill(1.0)
        delay_observer_kill(1.0)  # a second fit in the same process does not delay it twice
        clock = _Sleeps()
        monkeypatch.setattr(processes_module, "time", clock)
        assert observer._run()  # it found the failed stage and ended the run ...
        assert clock.slept == [1.0]  # ... after the grace, once
        monkeypatch.undo()
        assert rank_0.wait(timeout=10) < 0
    finally:
        reap([rank_0], grace_s=0.0)
