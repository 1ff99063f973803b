"""A latency table times its blocks in passes, each a share of the repeats: a slow spell of the machine lands in one
pass of a block, and the median over all its runs outvotes it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.searching import latency as latency_module
from lightning_naspipe.searching.table_passes import PASSES, inner_labels, reference_choices
from test_latency import _nested_supernet, _supernet
from test_timing import _Clock


def test_a_slow_spell_at_the_start_lands_in_one_pass_and_the_median_outvotes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The first block (one entry) runs first: 2 warm-up runs, then its runs of the first pass. A spell of 7 runs at
    # 20 ms covers 5 of its 9 timed runs when one pass takes them all, 3 of 9 when each of 3 passes takes 3.
    spell = [20.0] * 7 + [2.0] * 10_000
    x = torch.randn(8, 4)
    assert PASSES == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spell makes the runs spread: the table warns, rightly
        table = lnp.LatencyTable.measure(_supernet(), x, repeats=9, clock=_Clock(spell))
        assert table.entries[0] == pytest.approx((2.0,)) and table.entries[-1] == pytest.approx((2.0,))
        monkeypatch.setattr(latency_module, "PASSES", 1)
        one_pass = lnp.LatencyTable.measure(_supernet(), x, repeats=9, clock=_Clock(spell))
        assert one_pass.entries[0] == pytest.approx((20.0,))


def test_passes_keep_every_entry_and_delta_of_one_pass() -> None:
    """On a steady clock the passes change nothing: the same entries and nested deltas as one pass, and a table of
    fewer repeats than passes takes one run per pass."""
    supernet, x = _nested_supernet(), torch.randn(8, 4)
    steady = lnp.LatencyTable.measure(supernet, x, repeats=6, clock=_Clock([2.0]))
    assert all(t == pytest.approx(2.0) for row in steady.entries for t in row)
    assert [label for label, _ in steady.nested[1]] == list(inner_labels(supernet.blocks[1]))
    assert all(d == 0.0 for _, deltas in steady.nested[1] for d in deltas)
    once = lnp.LatencyTable.measure(supernet, x, repeats=1, clock=_Clock([2.0]))
    assert [pytest.approx(row) for row in once.entries] == list(steady.entries)


def test_deltas_are_taken_around_the_middle_of_shared_widths_only() -> None:
    """An elastic width several blocks read is centred; an op choice several cells share, a width one block reads
    and a block's own choice are taken around their first choice."""
    def cell() -> nn.Sequential:  # a shared op choice inside each block, as NB201's edges
        return nn.Sequential(lnp.ChoiceBlock([nn.Identity(), nn.ReLU(), nn.Tanh()], label="op"), nn.Identity())

    supernet = lnp.Supernet(
        lnp.ElasticLinear(4, [8, 16, 32, 64], label="width"),
        nn.Sequential(lnp.ElasticLinear([8, 16, 32, 64], 16, in_label="width"), nn.ReLU()),
        nn.Sequential(lnp.ElasticLinear(16, [4, 8, 16], label="alone"), lnp.ElasticLinear([4, 8, 16], 16,
                                                                                          in_label="alone")),
        cell(), cell(), lnp.ChoiceBlock([nn.Identity(), nn.ReLU(), nn.GELU()], label="own"))
    assert reference_choices(supernet) == {"width": 1, "alone": 0, "op": 0, "own": 0}
