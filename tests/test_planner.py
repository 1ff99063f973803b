"""The schedule simulator and planner: its model, its spec and its CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.planning import planner
from lightning_naspipe.planning.planner import best_layout, fitting_layouts, plan, plan_layouts, simulate
from lightning_naspipe.planning.space_spec import BlockSpec, CandidateSpec, SpaceSpec, wide_spec
from lightning_naspipe.planning.stalls import CAUSES
from lightning_naspipe.planning import profile_supernet
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture


def mixed_spec() -> SpaceSpec:
    """A fixed stem, two blocks sharing a label, a stateless candidate, costs on the 10 µs tick grid."""
    op = CandidateSpec
    return SpaceSpec([
        BlockSpec(None, [op(0.5, 1.0, True)]),
        BlockSpec("a", [op(1.0, 2.0, True), op(0.3, 0.4, False), op(2.0, 3.0, True)]),
        BlockSpec("b", [op(0.7, 1.1, True), op(0.2, 0.3, True)]),
        BlockSpec("a", [op(0.4, 0.9, True), op(0.1, 0.1, False), op(1.2, 2.5, True)]),
        BlockSpec("c", [op(0.6, 1.3, True) for _ in range(4)]),
    ], update_ms=0.05, action_overhead_ms=0.02)


def test_one_stage_is_the_sum_of_the_costs() -> None:
    spec = mixed_spec()
    archs = [uniform_architecture(spec.labels(), 7, i) for i in range(12)]
    pred = simulate(spec, 1, 4, architectures=archs, batch_size=10)
    expected = 0.0
    for arch in archs:
        ops = [b.candidates[0 if b.label is None else arch[b.label]] for b in spec.blocks]
        expected += sum(o.forward_ms + o.backward_ms for o in ops) + 3 * spec.action_overhead_ms
        expected += spec.update_ms * sum(o.stateful for o in ops)
    assert pred.makespan_ms == pytest.approx(expected)
    assert pred.subnets_per_s == pytest.approx(12 / expected * 1000)
    assert pred.samples_per_s == pytest.approx(10 * pred.subnets_per_s)
    assert pred.bubble_ratio == pytest.approx(0.0) and pred.inflight_max == (1,)


def test_disjoint_resources_overlap_with_two_stages_and_a_window() -> None:
    spec = wide_spec(64, block_ms=1.0)
    one = simulate(spec, 1, 16).subnets_per_s
    window_1 = simulate(spec, 2, 1, lookahead=False).subnets_per_s
    window_16 = simulate(spec, 2, 16)
    assert window_1 == pytest.approx(one, rel=0.05)  # one subnet at a time: no faster than one device
    # Lookahead: the next window's subnet forwards while this one drains, so even window 1 pipelines.
    assert simulate(spec, 2, 1).subnets_per_s > 1.5 * one
    assert window_16.subnets_per_s > 1.6 * one
    assert max(window_16.inflight_max) > 2 and window_16.bubble_ratio < 0.25


def test_trainable_fixed_blocks_never_overlap() -> None:
    spec = SpaceSpec([BlockSpec(None, [CandidateSpec(1.0, 2.0, True)]) for _ in range(4)])
    csp = simulate(spec, 2, 8)
    assert csp.inflight_max == (1, 1)
    assert csp.makespan_ms == pytest.approx(simulate(spec, 2, 8, schedule="one_in_flight").makespan_ms)
    assert csp.stall_split()["dependency"] > 0.3  # every next subnet waits for the previous update
    assert csp.subnets_per_s < 1.05 * simulate(spec, 1, 8).subnets_per_s


def test_stages_read_the_next_windows_batches_while_they_wait() -> None:
    # Fully serialised (every subnet trains every block): each stage waits ~6 ms per subnet for the
    # other, so reading a window's batches (subnet_overhead_ms each) hides in the window before;
    # only the first window pays it. Without lookahead the model keeps windows apart and charges it all.
    spec = SpaceSpec([BlockSpec(None, [CandidateSpec(1.0, 2.0, True)]) for _ in range(4)])
    base = simulate(spec, 2, 8, subnets=32)
    spec.subnet_overhead_ms = 0.5
    read = simulate(spec, 2, 8, subnets=32)
    assert read.makespan_ms == pytest.approx(base.makespan_ms + 8 * 0.5)
    assert all(st["overhead"] == pytest.approx(8 * 0.5) for st in read.stalls_ms)
    spec.subnet_overhead_ms = 20.0  # more than the waits: the rest is paid at each window's start
    assert simulate(spec, 2, 8, subnets=32).makespan_ms > base.makespan_ms + 8 * 20.0 + 3 * 8 * (20.0 - 7.0)
    apart = dataclasses.replace(spec, subnet_overhead_ms=0.5)
    assert simulate(apart, 2, 8, subnets=32, lookahead=False).makespan_ms == pytest.approx(
        simulate(spec, 2, 8, subnets=32, lookahead=False).makespan_ms - 32 * 19.5)


def test_one_in_flight_is_slower_than_csp_and_async_is_not() -> None:
    spec = wide_spec(16)
    rates = {mode: simulate(spec, 4, 16, schedule=mode).subnets_per_s for mode in planner.SCHEDULES}
    assert rates["one_in_flight"] < 0.8 * rates["csp"] <= rates["async"]
    assert rates["gpipe"] == rates["one_in_flight"]


@pytest.mark.parametrize(("stages", "window", "chunks", "message_ms"), [(2, 4, 1, 0.0), (3, 8, 2, 0.3), (5, 6, 3, 1.0)])
def test_stall_causes_add_up_to_the_idle_time(stages: int, window: int, chunks: int, message_ms: float) -> None:
    spec = mixed_spec()
    spec.message_ms, spec.step_overhead_ms, spec.sync_ms = message_ms, 0.5, 0.25
    pred = simulate(spec, stages, window, chunks, subnets=3 * window)
    for s in range(stages):
        assert set(pred.stalls_ms[s]) == set(CAUSES)
        assert pred.busy_ms[s] + sum(pred.stalls_ms[s].values()) == pytest.approx(pred.makespan_ms)
        assert pred.stalls_ms[s]["overhead"] == pytest.approx(3 * 0.75)
    idle = sum(sum(st.values()) for st in pred.stalls_ms)
    assert pred.bubble_ratio == pytest.approx(idle / (stages * pred.makespan_ms))
    assert sum(pred.stall_split().values()) == pytest.approx(1.0)
    assert (pred.stall_split()["communication"] > 0) == (message_ms > 0)
    assert all(1 <= m <= window and 0 < mean <= m for m, mean in zip(pred.inflight_max, pred.inflight_mean))


def test_engine_order_and_overhead_terms() -> None:
    spec = mixed_spec()
    greedy = simulate(spec, 3, 8, 2, order="greedy")
    assert all(st["order"] == 0 for st in greedy.stalls_ms)  # a greedy list schedule never idles with work ready
    spec.message_ms, spec.message_cpu_ms = 1.0, 0.2
    slow = simulate(spec, 3, 8, 2).makespan_ms
    spec.parallel_slowdown = 2.0
    assert simulate(spec, 3, 8, 2).makespan_ms > slow
    assert simulate(spec, 1, 8).makespan_ms == pytest.approx(simulate(mixed_spec(), 1, 8).makespan_ms)
    spec.subnet_overhead_ms = 0.5
    before = simulate(mixed_spec(), 1, 8, subnets=16).makespan_ms
    assert simulate(spec, 1, 8, subnets=16).makespan_ms == pytest.approx(before + 16 * 0.5)


def test_simulate_validates_its_arguments() -> None:
    spec = mixed_spec()
    with pytest.raises(ValueError, match="stages"):
        simulate(spec, 6, 4)
    with pytest.raises(ValueError, match="candidate per label"):
        simulate(spec, 2, 4, architectures=[{"a": 0, "b": 5, "c": 0}])
    assert [p.stages for p in plan(spec, window=4)] == [1, 2, 4]  # 8..64 exceed the 5 blocks


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
def test_cli_prints_a_table() -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_naspipe", "plan", "--wide", "8", "--batch-size", "32"],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stages", "subnets/s"])
    assert [line.split()[0] for line in lines[head + 1:head + 5]] == ["1", "2", "4", "8"]
    assert "skipped stage counts [16, 32, 64]" in done.stdout


def test_layouts_are_every_divisor_that_fits_the_blocks_and_the_chunks() -> None:
    spec = mixed_spec()  # 5 blocks
    assert [p.layout for p in plan_layouts(spec, 4, 4, chunks=4)] == ["1x4", "2x2", "4x1"]
    assert [p.layout for p in plan_layouts(spec, 4, 4, chunks=2)] == ["2x2", "4x1"]  # 4 replicas need 4 chunks
    assert [p.layout for p in plan_layouts(spec, 6, 4, chunks=6)] == ["1x6", "2x3", "3x2"]  # 6 stages > 5 blocks
    with pytest.raises(ValueError, match="multiple of replicas=2"):
        simulate(spec, 1, 4, chunks=3, replicas=2)
    assert fitting_layouts(4, 5, 4) == [(1, 4), (2, 2), (4, 1)] and fitting_layouts(6, 5, 6) == [(1, 6), (2, 3), (3, 2)]
    assert fitting_layouts(2, 5, 1) == [(2, 1)] and fitting_layouts(3, 2, 1) == []  # 3 stages > 2 blocks, 1 chunk


def test_replicas_share_the_compute_of_a_space_stages_cannot_overlap() -> None:
    """Every subnet trains the trainable stem and head: stages serialise, replicas split each batch."""
    spec = SpaceSpec([BlockSpec(None, [CandidateSpec(1.0, 2.0, True)])] + [
        BlockSpec(f"c{i}", [CandidateSpec(1.0, 2.0, True) for _ in range(4)]) for i in range(4)]
        + [BlockSpec(None, [CandidateSpec(1.0, 2.0, True)])])
    one = simulate(spec, 1, 8, chunks=2).subnets_per_s
    layouts = {p.layout: p for p in plan_layouts(spec, 2, 8, chunks=2)}
    assert layouts["1x2"].subnets_per_s == pytest.approx(2 * one, rel=0.05)  # no messages modelled: half each
    assert layouts["2x1"].subnets_per_s < 1.6 * one
    assert best_layout(list(layouts.values())).layout == "1x2"
    costly = dataclasses.replace(spec, message_ms=2.0)  # the chained reduction now costs 2 x 2 ms per update
    assert simulate(costly, 1, 8, chunks=2, replicas=2).subnets_per_s < 0.8 * layouts["1x2"].subnets_per_s


def test_steps_of_several_subnets_open_layouts_and_count_steps() -> None:
    """``Sandwich(2)`` (4 subnets per step) at ``chunks=1``: 2 replicas share each step's 4 micro-batches, a
    layout that one subnet per step leaves out; a step costs 4 subnets' compute, so the rates count steps."""
    spec = mixed_spec()
    assert [p.layout for p in plan_layouts(spec, 2, 8, chunks=1)] == ["2x1"]
    steps = {p.layout: p for p in plan_layouts(spec, 2, 8, chunks=1, subnets_per_step=4)}
    assert list(steps) == ["1x2", "2x1"]
    # 3 micro-batches per step: no 2 or 4 replicas share them
    assert [p.layout for p in plan_layouts(spec, 4, 8, chunks=1, subnets_per_step=3)] == ["4x1"]
    one = simulate(spec, 1, 8, chunks=1).subnets_per_s
    alone = plan_layouts(spec, 1, 8, chunks=1, subnets_per_step=4)[0].subnets_per_s
    assert alone == pytest.approx(one / 4, rel=0.25)  # one update per step instead of four
    assert alone < one / 3


def test_plan_by_stage_count_takes_steps_of_several_subnets_too() -> None:
    spec = mixed_spec()
    by_stages = plan(spec, (1, 2), 8, chunks=1, subnets_per_step=4)
    by_layouts = {p.layout: p for p in plan_layouts(spec, 2, 8, chunks=1, subnets_per_step=4)}
    assert [p.subnets_per_s for p in by_stages] == [plan_layouts(spec, 1, 8, chunks=1, subnets_per_step=4)[0]
                                                    .subnets_per_s, by_layouts["2x1"].subnets_per_s]
    assert by_stages[0].chunks == 4  # a step's 4 subnets flow as 4 micro-batches
    with pytest.raises(ValueError, match="subnets_per_step must be >= 1"):
        plan(spec, (1,), 8, subnets_per_step=0)


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
def test_cli_plans_steps_of_several_subnets_at_the_strategys_window() -> None:
    """``--subnets-per-step 4`` opens the 2-replica layout of 2 processes at chunks 1 (``Sandwich(2)``), says that the
    rates count steps, and plans at window 8, ``NASPipeStrategy``'s default; 0 is a usage error."""
    command = [sys.executable, "-m", "lightning_naspipe", "plan", "--wide", "8", "--processes", "2"]
    done = subprocess.run([*command, "--subnets-per-step", "4"], capture_output=True, text=True, timeout=120,
                          check=True)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("space: wide") and "window 8," in lines[0] and "steps simulated" in lines[0]
    assert "the rates count steps" in done.stdout
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["S", "x"])
    assert [line.split()[0] for line in lines[head + 1:head + 3]] == ["1x2", "2x1"]
    refused = subprocess.run([*command, "--subnets-per-step", "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--subnets-per-step must be >= 1" in refused.stderr


@pytest.mark.slow  # thousands of examples or a fresh interpreter: the full suite runs it, not the inner loop
def test_cli_predicts_every_layout_and_names_the_best() -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_naspipe", "plan", "--wide", "8", "--processes", "4",
                           "--chunks", "4"], capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["S", "x"])
    assert [line.split()[0] for line in lines[head + 1:head + 4]] == ["1x4", "2x2", "4x1"]
    assert "best layout for 4 processes:" in done.stdout and "NASPipeStrategy(num_stages=" in done.stdout


def test_profiling_leaves_the_weights_and_the_global_rng_alone() -> None:
    """Profiling a real supernet measures it without touching what training will use: the global RNG, the weights
    and their gradients. (How close its prediction comes to the engine is a timing: benchmarks/engine_prediction.py.)"""
    torch.manual_seed(0)
    net = lnp.Supernet(nn.Linear(16, 16), *[
        lnp.ChoiceBlock([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)] + [nn.Identity()])
        for _ in range(2)])
    sample = torch.randn(4, 16)
    rng_state, weights = torch.get_rng_state(), [p.clone() for p in net.parameters()]
    spec = profile_supernet(net, sample, repeats=1, clock=time.thread_time, engine_seconds=0.01)
    assert torch.equal(rng_state, torch.get_rng_state())
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(weights, net.parameters()))
    assert spec.labels() == net.labels and spec.blocks[1].candidates[-1].stateful is False


def test_lookahead_fills_the_drain_unless_buffers_keep_forwards_in_their_window() -> None:
    spec = wide_spec(64, block_ms=1.0)
    on, off = simulate(spec, 2, 8), simulate(spec, 2, 8, lookahead=False)
    assert on.subnets_per_s > 1.05 * off.subnets_per_s
    assert sum(on.stalls_ms[0].values()) < sum(off.stalls_ms[0].values())
    for block in spec.blocks:
        block.candidates = [dataclasses.replace(c, buffers=True) for c in block.candidates]
    # No forward runs ahead; the stages still run their windows back to back (no barrier at window ends).
    assert off.subnets_per_s <= simulate(spec, 2, 8).subnets_per_s < on.subnets_per_s


def stem_spec(input_ms: float, weight_ms: float) -> SpaceSpec:
    """A trainable stem on every subnet (so windows are serialised for stage 1), then choice blocks whose
    backward is 3 ms one pass, or ``input_ms`` + ``weight_ms`` deferred."""
    op = CandidateSpec(1.0, 3.0, True, False, input_ms, weight_ms)
    return SpaceSpec([BlockSpec(None, [CandidateSpec(2.0, 4.0, True)]), BlockSpec("a", [op] * 4),
                      BlockSpec("b", [op] * 4), BlockSpec("c", [op] * 4)])


def test_deferred_weight_grads_send_sooner_where_a_stem_serialises_the_pipeline() -> None:
    spec = stem_spec(1.0, 2.2)
    kwargs: dict[str, Any] = dict(balance=[2, 2], subnets=32)
    never = simulate(spec, 2, 8, defer_weight_grads=False, **kwargs)
    forced = simulate(spec, 2, 8, defer_weight_grads=True, **kwargs)
    measured = simulate(spec, 2, 8, **kwargs)
    # One subnet in flight: F 3 + 2, stage 1's gradient after 3 (the loss block, one pass) + 1 instead of
    # 6 ms, stage 0's backward 7: about 16 ms a subnet instead of 18.
    assert forced.makespan_ms / 32 == pytest.approx(16.0, abs=0.2) and never.makespan_ms / 32 == pytest.approx(
        18.0, abs=0.2)
    assert measured.makespan_ms == forced.makespan_ms  # 4 ms < 0.95 x 6 ms: the engine's rule defers
    assert forced.busy_ms[1] > never.busy_ms[1]  # the weight pass costs more than the one-pass share
    # Micro-batches: never eligible, so measured is one pass; unmeasured passes: one pass too.
    assert simulate(spec, 2, 8, chunks=2, **kwargs).makespan_ms == simulate(
        spec, 2, 8, chunks=2, defer_weight_grads=False, **kwargs).makespan_ms
    unmeasured = stem_spec(1.0, 2.2)
    for block in unmeasured.blocks:
        block.candidates = [dataclasses.replace(c, input_backward_ms=None) for c in block.candidates]
    assert simulate(unmeasured, 2, 8, **kwargs).makespan_ms == never.makespan_ms


def test_the_modelled_choice_keeps_one_pass_when_the_input_pass_is_not_clearly_faster() -> None:
    spec = stem_spec(2.9, 0.5)  # the input pass saves too little: 5.9 ms against 6 ms to send
    kwargs: dict[str, Any] = dict(balance=[2, 2], subnets=32)
    assert simulate(spec, 2, 8, **kwargs).makespan_ms == simulate(spec, 2, 8, defer_weight_grads=False,
                                                                  **kwargs).makespan_ms
    independent = SpaceSpec([BlockSpec(f"l{i}", [CandidateSpec(1.0, 3.0, True, False, 1.0, 2.2)] * 32)
                             for i in range(4)])  # 32 candidates: consecutive subnets rarely share
    assert simulate(independent, 2, 8, subnets=32).makespan_ms == simulate(
        independent, 2, 8, subnets=32, defer_weight_grads=False).makespan_ms
