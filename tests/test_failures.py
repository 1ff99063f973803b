"""FailureBoard: a failing stage's error, read by the others from the process group's store."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_naspipe.transport import failures
from lightning_naspipe.transport.failures import FailureBoard
from lightning_naspipe.transport.p2p import StageFailure


class _UnreachableStore:
    def set(self, key: str, value: str) -> None:
        raise RuntimeError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def _boards(store: object, stages: list[int]) -> list[FailureBoard]:
    # Each process builds its n-th board for the same run; in one process, build them by hand alike.
    names = [f"stage {stage} (rank {rank})" for rank, stage in enumerate(stages)]
    boards = [FailureBoard(store, rank, names) for rank in range(len(stages))]
    for board in boards[1:]:
        board._key = boards[0]._key
    return boards


def test_a_posted_error_names_its_stage_rank_type_and_message_for_the_others() -> None:
    boards = _boards(dist.HashStore(), [0, 1, 2])
    boards[2].post(ValueError("Expected more than 1 value per channel"))
    boards[2].post(RuntimeError("a later, secondary error"))  # only the first counts
    expected = ["Pipeline stage 2 (rank 2) raised ValueError: Expected more than 1 value per channel"]
    assert boards[0].causes(wait_s=0) == expected
    assert boards[1].causes(wait_s=0) == expected
    assert boards[2].causes(wait_s=0) == []  # a stage does not explain its own error to itself


class _FakeTime:
    """The board's clock: sleeping advances it, nothing else does."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_no_post_means_no_cause_after_the_wait_and_an_unreachable_store_is_no_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    board = _boards(dist.HashStore(), [0, 1])[0]
    clock = _FakeTime()
    monkeypatch.setattr(failures, "time", clock)
    assert board.causes(wait_s=0.2) == []
    assert 0.2 <= clock.now - 100.0 < 0.2 + 0.05 + 1e-9  # polled for the whole wait, and no poll more
    monkeypatch.undo()
    gone = FailureBoard(_UnreachableStore(), 1, ["stage 0 (rank 0)", "stage 1 (rank 1)"])
    gone.post(ValueError("boom"))
    assert gone.causes(wait_s=0) == []
    assert FailureBoard(None, 0, ["stage 0 (rank 0)", "stage 1 (rank 1)"]).causes() == []


def test_boards_of_a_later_run_do_not_see_an_earlier_runs_posts() -> None:
    store = dist.HashStore()
    earlier = _boards(store, [0, 1])
    earlier[1].post(ValueError("from the first fit"))
    later = _boards(store, [0, 1])
    assert later[0].causes(wait_s=0) == []


def test_an_own_error_is_the_cause_and_a_lost_neighbour_only_when_no_stage_posted_one() -> None:
    boards = _boards(dist.HashStore(), [0, 1, 2])
    boards[0].post(StageFailure("Pipeline stage 1 (rank 1) failed or exited: it stopped sending (timeout)."))
    assert boards[1].causes(wait_s=0.1) == [
        "Pipeline stage 0 (rank 0) raised StageFailure: Pipeline stage 1 (rank 1) failed or exited: it stopped "
        "sending (timeout)."]
    boards[2].post(ValueError("boom"))
    assert boards[1].causes(wait_s=0) == ["Pipeline stage 2 (rank 2) raised ValueError: boom"]
