"""Latency tables on two spaces the table was not written against (benchmarks/latency_spaces.py, also timed for real
by benchmarks/latency_error.py): an AutoFormer-style ViT (a shared embedding width, per-layer heads and MLP ratio,
the last layers under ElasticDepth) and an OFA-style CNN (ElasticDepth units whose layers' expansion, kernel and a
user's own Elastic squeeze-excite are labels inside the depth). With a deterministic fake timing that is additive
over labels, every label is keyed, predictions equal the fake end-to-end cost, and another space's table is
refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from helpers import fake_latency_timing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from latency_spaces import ElasticSqueezeExcite, SqueezeExcite, autoformer, ofa  # noqa: E402


def small_autoformer() -> tuple[lnp.Supernet, torch.Tensor]:
    return autoformer(dims=(4, 6, 8), heads=(1, 2), head_dim=2, ratios=(1.5, 2.0), layers=3, side=4, patch=2,
                      batch=2, classes=3)


def small_ofa(kernels: tuple[int, ...] = (3, 5)) -> tuple[lnp.Supernet, torch.Tensor]:
    return ofa(stem=4, units=(4, 8), layers=3, expansions=(1, 2), kernels=kernels, squeeze=(2, 4), side=8, batch=2,
               classes=3)


def shape_cost(module: nn.Module) -> float:
    """A fake latency, additive over the labels of slicing elastic modules: each parameter costs the sum of its
    dimensions (a (w, c, k, k) convolution w + c + 2k), so one label's choice adds the same wherever the others
    are, except where one size is a product of two labels (an MLP's hidden width is its ratio times the embedding
    width) or a label sits in a layer a depth choice removes."""
    return sum(sum(p.shape) for p in module.parameters()) / 100


@pytest.fixture
def fake_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timing (the table's in place, the end-to-end one) is the timed module's shape_cost."""
    fake_latency_timing(monkeypatch, shape_cost)


def keyed(table: lnp.LatencyTable) -> set[str]:
    return {label for label in table.labels if label is not None} | {
        label for block in table.nested for label, _ in block}


def test_the_ofa_space_has_labels_inside_its_depths_and_a_users_elastic_module_that_freezes_bitwise() -> None:
    supernet, x = small_ofa()
    labels = supernet.labels
    assert labels["depth0"] == labels["depth1"] == 3
    assert {"u0l2.expand", "u0l2.kernel", "u0l2.squeeze", "u1l1.squeeze"} <= set(labels)
    assert sum(isinstance(m, ElasticSqueezeExcite) for m in supernet.modules()) == 6
    for i in range(5):
        arch = uniform_architecture(labels, 3, i)
        frozen = supernet.freeze(arch)
        assert not any(isinstance(m, lnp.Elastic) for m in frozen.modules())
        assert sum(isinstance(m, SqueezeExcite) for m in frozen.modules()) == arch["depth0"] + arch["depth1"] + 2
        with torch.no_grad():
            assert torch.allclose(supernet(x, arch), frozen(x), atol=1e-6), arch


@pytest.mark.usefixtures("fake_timing")
def test_an_ofa_table_keys_every_label_and_predicts_the_end_to_end_cost() -> None:
    supernet, x = small_ofa()
    table = lnp.LatencyTable.measure(supernet, x, repeats=1)
    assert keyed(table) == set(supernet.labels)
    assert table.labels == (None,) * 4 and table.nested[0] == table.nested[3] == ()
    # The third layer of a unit runs only at depth 3: its labels are timed there, not at the reference (depth 1),
    # where they would cost nothing. The user's squeeze width is keyed like a built-in's.
    for unit in (0, 1):
        rows = dict(table.nested[1 + unit])
        for layer in range(3):
            for name in ("expand", "kernel", "squeeze"):
                deltas = rows[f"u{unit}l{layer}.{name}"]
                assert deltas[0] == 0.0 and all(b > a for a, b in zip(deltas, deltas[1:])), (unit, layer, name)
    report = table.error(supernet, x, samples=12, seed=0, repeats=1)
    assert len(report.rows) == 12 and {a["depth0"] for a, _, _ in report.rows} == {0, 1, 2}
    for arch, predicted, measured in report.rows:
        assert predicted == pytest.approx(measured, rel=1e-9), arch
        assert measured == pytest.approx(shape_cost(supernet.freeze(arch)), rel=1e-12)


@pytest.mark.usefixtures("fake_timing")
def test_an_autoformer_table_keys_every_label_and_predicts_exactly_where_the_cost_is_additive() -> None:
    supernet, x = small_autoformer()
    table = lnp.LatencyTable.measure(supernet, x, repeats=1)
    assert keyed(table) == set(supernet.labels)
    depth = dict(table.nested[2])
    assert set(depth) == {"depth", "embed"} | {label for label in supernet.labels if label.startswith("block2.layers")}
    for label in ("block2.layers.0.body.attention.heads", "block2.layers.1.body.mlp.hidden"):
        assert depth[label][0] == 0.0 and depth[label][-1] > 0, label  # timed where the depth runs that layer
    # The shared embedding width is timed around its middle choice, where the depth runs a layer too.
    assert depth["embed"][0] < depth["embed"][1] == 0.0 < depth["embed"][2]
    # At the reference embedding width every other label adds the same wherever the others are: exact.
    archs = [uniform_architecture(supernet.labels, 5, i) | {"embed": 1} for i in range(12)]
    assert {a["depth"] for a in archs} == {0, 1, 2}
    report = table.error(supernet, x, architectures=archs, repeats=1)
    for arch, predicted, measured in report.rows:
        assert predicted == pytest.approx(measured, rel=1e-9), arch
    # A block adds the embedding width's delta only where it runs a layer that reads it: exact at depths 0 and 1
    # (the depth's delta is timed with one layer), whatever the width, the other labels at the reference.
    for embed in range(3):
        for d in (0, 1):
            arch = {label: 0 for label in supernet.labels} | {"embed": embed, "depth": d}
            assert table.predict(arch, supernet) == pytest.approx(shape_cost(supernet.freeze(arch)), rel=1e-9)
    # Elsewhere the additive table errs where sizes multiply (the MLP's hidden width is its ratio times the
    # embedding width; two layers read the width at depth 2), but not far under this cost.
    wide = table.error(supernet, x, samples=12, seed=0, repeats=1)
    assert {a["embed"] for a, _, _ in wide.rows} == {0, 1, 2} and wide.worst_pct < 15


def test_a_table_of_another_space_is_refused(fake_timing: None) -> None:
    ofa_net, ofa_x = small_ofa()
    vit, vit_x = small_autoformer()
    table = lnp.LatencyTable.measure(ofa_net, ofa_x, repeats=1)
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        table.check(vit)
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        table.predict({label: 0 for label in vit.labels}, vit)
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        table.error(vit, vit_x, samples=2, repeats=1)
    with pytest.raises(lnp.NASPipeConfigError, match=r"label 'depth0' is missing.*not of the table's space"):
        table.predict({label: 0 for label in vit.labels})
    # The same layout with another kernel choice inside the depths: refused on the nested labels' counts.
    wider, _ = small_ofa(kernels=(3, 5, 7))
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        table.check(wider)
    table.check(small_ofa()[0])  # a fresh copy of the same space is accepted
