"""The teacher relay along a stage's replicas, in one process (replica threads), and the schedule it relies on:
on the last stage no update between one step's forwards (the multi-process runs: test_recipes_stages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.schedule.actions import FORWARD, UPDATE
from lightning_naspipe.pipeline.exactness.distillation import Teachers, wants_teacher
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.pipeline.runtime.window_plan import plan_window
from test_replicas import _Group, _World


@pytest.mark.parametrize(("subnets", "pieces", "replicas"), [(3, 2, 2), (4, 1, 2), (2, 4, 4), (4, 2, 2), (3, 4, 4)])
def test_every_replica_gets_the_teacher_of_every_piece_its_share_needs(subnets: int, pieces: int,
                                                                      replicas: int) -> None:
    """Micro-batch ``m`` of a step is subnet ``m // pieces`` on piece ``m % pieces``; replica ``r`` trains a
    contiguous share. Each runs its forwards in order as the executor does: relay, then keep a first subnet's output."""
    world, share = _World(replicas), subnets * pieces // replicas
    found: dict[int, dict[int, torch.Tensor | None]] = {}

    def run(replica: int) -> None:
        teachers, seen = Teachers(_Group(replica, world)), {}
        for c in range(share):
            m = replica * share + c
            subnet, piece = divmod(m, pieces)
            teachers.relay(7, c, pieces, replica * share)
            if subnet == 0:
                teachers.keep(7, piece, torch.full((2,), float(piece)).requires_grad_())
            else:
                seen[m] = teachers.teacher(7, piece)
        teachers.drop_from(7, 7)
        assert not teachers._kept
        found[replica] = seen

    world.run(run)
    needed = set(range(pieces, subnets * pieces))
    assert {m for seen in found.values() for m in seen} == needed
    for seen in found.values():
        for m, teacher in seen.items():
            assert teacher is not None and not teacher.requires_grad
            assert torch.equal(teacher, torch.full((2,), float(m % pieces)))
    assert all(q.empty() for q in world.queues.values()), "a message nobody received"


def test_wants_teacher_reads_compute_losss_parameters() -> None:
    class Plain:
        def compute_loss(self, output: object, batch: object) -> None: ...

    class Distilling:
        def compute_loss(self, output: object, batch: object, teacher: object = None) -> None: ...

    assert not wants_teacher(Plain()) and wants_teacher(Distilling())


def test_a_chained_last_stage_runs_no_update_between_a_steps_forwards() -> None:
    """A step that shares nothing with the one before may overtake it on the last stage, so that an update runs
    between its forwards there; ``chained_last`` keeps the steps in order there."""
    torch.manual_seed(0)
    supernet = lnp.Supernet(*(lnp.ChoiceBlock([nn.Linear(4, 4) for _ in range(4)], label=label) for label in "ab"))
    # steps 0 and 1 train candidates 0 and 1, steps 2 and 3 candidates 2 and 3: step 2 may overtake step 1
    steps = [[{"a": 2 * (k // 2) + j, "b": 2 * (k // 2) + j} for j in range(2)] for k in range(4)]
    window = Window(0, [step[0] for step in steps], [[(None, 0.5), (None, 0.5)] for _ in steps], steps=steps)
    ranges = [range(0, 1), range(1, 2)]

    def interleaved(chained: bool) -> bool:
        plan = plan_window(supernet, window, ranges, "csp", 4, chained_last=chained)
        open_steps: set[int] = set()
        for action in plan.actions(1):
            if action.kind == FORWARD:
                open_steps.add(action.subnet)
            if action.kind == FORWARD and action.chunk == 3:
                open_steps.discard(action.subnet)
            if action.kind == UPDATE and open_steps:
                return True
        return False

    assert interleaved(False), "the test's steps must interleave without the chain"
    assert not interleaved(True)
    assert plan_window(supernet, window, ranges, "csp", 4, chained_last=True).resources == \
        plan_window(supernet, window, ranges, "csp", 4).resources, "updates still step the real resources"
