"""The latency lookup table: measured in place, predictions are sums of entries, saved and loaded, its error
against end-to-end latency, the command that builds it; a latency budget in lnp.search (an impossible one refused
before any evaluation); measured latency logged and reused on resume; latency in the exported folder."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from helpers import fake_latency_timing
from lightning_naspipe.searching import latency as latency_module


def _supernet() -> lnp.Supernet:
    torch.manual_seed(0)
    return lnp.Supernet(nn.Linear(4, 8), lnp.ChoiceBlock([nn.Identity(), nn.Linear(8, 8), nn.Sequential(
        nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8))], label="a"),
        lnp.ChoiceBlock([nn.Tanh(), nn.Linear(8, 8)], label="b"), nn.Linear(8, 3))


class _Net(lnp.NASPipeMixin, torch.nn.Module):
    """Enough of a NASPipe module for lnp.search without a Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.supernet = _supernet()

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])


def test_a_prediction_is_the_sum_of_its_blocks_entries_and_the_table_round_trips(tmp_path: Path) -> None:
    supernet = _supernet()
    table = lnp.LatencyTable.measure(supernet, torch.randn(16, 4), repeats=3)
    assert table.labels == (None, "a", "b", None) and [len(row) for row in table.entries] == [1, 3, 2, 1]
    assert table.batch_size == 16 and table.device == "cpu" and all(t > 0 for row in table.entries for t in row)
    for i in range(6):
        arch = uniform_architecture(supernet.labels, 0, i)
        expected = table.entries[0][0] + table.entries[1][arch["a"]] + table.entries[2][arch["b"]] + table.entries[3][0]
        assert table.predict(arch) == expected
    assert table.fastest_ms() == sum(min(row) for row in table.entries)
    assert lnp.LatencyTable.load(table.save(tmp_path / "table.json")) == table


def test_a_latency_budget_filters_the_search_and_an_impossible_one_is_refused_before_evaluating() -> None:
    model = _Net()
    table = lnp.LatencyTable(((1.0,), (0.5, 2.0, 9.0), (0.25, 1.0), (1.0,)), (None, "a", "b", None), "cpu", 8)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    result = lnp.search(None, model, lnp.GridSearch(), data, latency=table, max_latency_ms=4.0)
    assert result.history and all(table.predict(r.architecture) <= 4.0 for r in result.history)
    assert {tuple(sorted(r.architecture.items())) for r in result.history} == {
        (("a", a), ("b", b)) for a in range(3) for b in range(2) if table.predict({"a": a, "b": b}) <= 4.0}
    with pytest.raises(lnp.NASPipeConfigError, match=r"max_latency_ms=2.5\): no architecture can meet it: the "
                                                     r"fastest predicted is 2\.750 ms"):
        lnp.search(None, model, lnp.GridSearch(), data, latency=table, max_latency_ms=2.5)
    with pytest.raises(lnp.NASPipeConfigError, match="needs latency="):
        lnp.search(None, model, lnp.GridSearch(), data, max_latency_ms=2.5)
    other = lnp.LatencyTable(((1.0,), (0.5, 2.0)), (None, "a"), "cpu", 8)
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        lnp.search(None, model, lnp.GridSearch(), data, latency=other, max_latency_ms=9.0)


def test_measured_latency_times_the_frozen_subnet_and_the_error_report_compares_it_with_predictions() -> None:
    supernet = _supernet()
    x = torch.randn(16, 4)
    assert lnp.measure_latency(supernet, {"a": 2, "b": 1}, x, repeats=3) > 0
    table = lnp.LatencyTable.measure(supernet, x, repeats=3)
    report = table.error(supernet, x, samples=8, seed=1, repeats=3)
    assert report.rows and report.device == "cpu" and report.batch_size == 16
    assert len({tuple(sorted(a.items())) for a, _, _ in report.rows}) == len(report.rows)  # one per subnet
    assert all(predicted == table.predict(a) and measured > 0 for a, predicted, measured in report.rows)
    # The statistics from known rows: errors of +10% and -30%.
    known = lnp.LatencyReport((({"a": 0, "b": 0}, 1.1, 1.0), ({"a": 1, "b": 0}, 1.4, 2.0)), "cpu", 16)
    assert known.errors_pct == pytest.approx((10.0, -30.0))
    assert known.mean_abs_pct == pytest.approx(20.0) and known.worst_pct == pytest.approx(30.0)
    assert known.bias_pct == pytest.approx(-10.0)
    assert "mean |error| 20.0%, worst 30.0%" in str(known)


def test_the_latency_command_saves_a_table_and_reports_its_error(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_naspipe.__main__ import main

    assert main(["latency", "--model", "test_latency:_Net", "--input-shape", "8,4", "--repeats", "2", "--output",
                 str(tmp_path / "t.json"), "--error-samples", "3"]) == 0
    table = lnp.LatencyTable.load(tmp_path / "t.json")
    assert table.labels == (None, "a", "b", None) and table.batch_size == 8
    out = capsys.readouterr().out
    assert "saved to" in out and "architectures on cpu, batch size 8: mean |error|" in out
    assert main(["latency", "--model", "no_colon", "--input-shape", "8,4"]) == 2


def _noisy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Replace the end-to-end measurement by a counted one whose value differs on every call (as noise would)."""
    calls: list[dict[str, int]] = []

    def fake(supernet: Any, architecture: Any, example_input: Any, repeats: int = 10, warmup: int = 2,
             **timing: Any) -> float:
        calls.append(dict(architecture))
        return 1.0 + architecture["a"] + 0.5 * architecture["b"] + 0.001 * len(calls)

    monkeypatch.setattr(latency_module, "measure_latency", fake)
    return calls


def test_a_resumed_measured_latency_search_reuses_every_logged_measurement(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model, log = _Net(), tmp_path / "search.jsonl"
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    limits = lnp.Constraints(latency="measured", max_latency_ms=3.2)
    calls = _noisy(monkeypatch)
    first = lnp.search(None, model, lnp.RandomSearch(3, seed=2), data, constraints=limits, log_path=log)
    assert all(r.latency_kind == "measured" and r.latency_ms is not None and r.latency_ms <= 3.2
               for r in first.history)
    measured = list(calls)
    assert len(measured) == len({tuple(sorted(a.items())) for a in measured})  # each subnet measured once
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum("measured_latency_ms" in line for line in lines) == len(measured)  # every measurement logged
    calls.clear()
    again = lnp.search(None, model, lnp.RandomSearch(3, seed=2), data, constraints=limits, log_path=log)
    assert calls == [] and again.history == first.history
    # Cut the log after its first two measurements (a search killed early): the resumed search measures only
    # what the log lacks and reuses the logged (noisy) values.
    head = log.read_text().splitlines(keepends=True)
    log.write_text("".join(head[:3]))
    calls.clear()
    resumed = lnp.search(None, model, lnp.RandomSearch(3, seed=2), data, constraints=limits, log_path=log)
    logged = {tuple(sorted(json.loads(line)["architecture"].items())): json.loads(line)["measured_latency_ms"]
              for line in head[1:3]}
    assert len(logged) == 2 and len(calls) == len(measured) - 2
    assert not {tuple(sorted(a.items())) for a in calls} & set(logged)
    assert [r.architecture for r in resumed.history] == [r.architecture for r in first.history]
    for r in resumed.history:
        if tuple(sorted(r.architecture.items())) in logged:
            assert r.latency_ms == logged[tuple(sorted(r.architecture.items()))]
    # Other constraints: the log is refused.
    with pytest.raises(lnp.NASPipeConfigError, match="constraints than this search's"):
        lnp.search(None, model, lnp.RandomSearch(3, seed=2), data, log_path=log,
                   constraints=lnp.Constraints(latency="measured", max_latency_ms=3.0))


# -- the checked winner: a budgeted search under a table times its best end to end before returning it ------------

#: Predictions: a0b0 2.75, a0b1 3.5, a1b0 4.25, a1b1 5.0, a2b0 11.25, a2b1 12.0 ms.
_TABLE = lnp.LatencyTable(((1.0,), (0.5, 2.0, 9.0), (0.25, 1.0), (1.0,)), (None, "a", "b", None), "cpu", 8)


def _timed(monkeypatch: pytest.MonkeyPatch, ms: Any) -> list[tuple[dict[str, int], int]]:
    """End-to-end measurement replaced by ``ms(architecture)``; each call's architecture and input batch size."""
    calls: list[tuple[dict[str, int], int]] = []

    def fake(supernet: Any, architecture: Any, example_input: Any, repeats: int = 10, warmup: int = 2,
             **timing: Any) -> float:
        calls.append((dict(architecture), latency_module.batch_size_of(example_input)))
        return float(ms(dict(architecture)))

    monkeypatch.setattr(latency_module, "measure_latency", fake)
    return calls


def test_a_budgeted_search_never_returns_a_predicted_feasible_architecture_that_measures_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, log = _Net(), tmp_path / "search.jsonl"
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 4, generator=generator), torch.randint(0, 3, (12,), generator=generator))]
    plain = lnp.search(None, model, lnp.GridSearch(), data,
                       constraints=lnp.Constraints(latency=_TABLE, max_latency_ms=5.0, check_top=0))
    ranked = [r.architecture for r in sorted(plain.history, key=lambda r: r.score)]
    assert len(ranked) == 4 and all(_TABLE.predict(a) <= 5.0 for a in ranked)  # a0b0, a0b1, a1b0, a1b1
    top, second = ranked[:2]
    # The best scored measures 9 ms end to end; every other 5.2 ms: over 5.0, within the 5% margin (5.25 ms).
    calls = _timed(monkeypatch, lambda a: 9.0 if a == top else 5.2)
    limits = lnp.Constraints(latency=_TABLE, max_latency_ms=5.0)
    dropped = (rf"architecture {re.escape(str(top))} \(record \d+, score [\d.e-]+\) was predicted at "
               rf"{_TABLE.predict(top):.4f} ms, within max_latency_ms=5.0, but measures 9.0000 ms end to end \(on cpu "
               r"at batch size 8, with the 5% margin: at most 5.2500 ms\): it is dropped")
    with pytest.warns(UserWarning, match=dropped):
        result = lnp.search(None, model, lnp.GridSearch(), data, constraints=limits, log_path=log)
    assert result.best == second != top
    best = result.best_record
    assert best.measured_latency_ms == 5.2 and not best.over_budget and best.latency_ms == _TABLE.predict(second)
    over = next(r for r in result.history if r.architecture == top)
    assert over.over_budget and over.measured_latency_ms == 9.0
    assert over.latency_ms == _TABLE.predict(top) and over.latency_kind == "predicted"  # the prediction stays
    assert all(r.measured_latency_ms is None and not r.over_budget for r in result.history if r not in (best, over))
    assert calls == [(top, 8), (second, 8)]  # best first, until one fits; at the table's batch size (data: 12)
    assert result.history == plain.history  # the same evaluation; the check's fields are not compared
    lines = result.table().splitlines()
    assert "measured" in lines[0] and lines[1].split()[0] == "-" and lines[2].split()[0] == "1"
    assert lines[-1].startswith("rank -: measured end to end over the latency budget")
    logged = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert [(line["architecture"], line["measured_latency_ms"]) for line in logged if "index" not in line] == [
        (top, 9.0), (second, 5.2)]
    # Resumed from the log: nothing evaluated or measured again, the same decision.
    calls.clear()
    with pytest.warns(UserWarning, match=dropped):  # the log keeps the measurements: the same warning
        again = lnp.search(None, model, lnp.GridSearch(), data, constraints=limits, log_path=log)
    assert calls == [] and again.best == second
    assert [(r.measured_latency_ms, r.over_budget) for r in again.history] == [
        (r.measured_latency_ms, r.over_budget) for r in result.history]
    # Without a margin every one measures over: the search says what it measured instead of returning one.
    with pytest.raises(lnp.NASPipeConfigError, match=r"none of the 4 best architectures predicted within "
                                                     r"max_latency_ms=5.0 measures within it.*measured 9.0000 ms"), \
            pytest.warns(UserWarning, match="it is dropped"):
        lnp.search(None, model, lnp.GridSearch(), data,
                   constraints=lnp.Constraints(latency=_TABLE, max_latency_ms=5.0, check_margin=0.0))
    with pytest.raises(lnp.NASPipeConfigError, match="none of the 1 best"), pytest.warns(UserWarning):
        lnp.search(None, model, lnp.GridSearch(), data,
                   constraints=lnp.Constraints(latency=_TABLE, max_latency_ms=5.0, check_top=1))
    with pytest.raises(lnp.NASPipeConfigError, match="Every record .* measured over its latency budget"):
        _ = lnp.SearchResult([dataclasses.replace(r, over_budget=True) for r in plain.history], False).best
    for bad in (dict(check_top=-1), dict(check_margin=-0.1)):
        with pytest.raises(lnp.NASPipeConfigError, match=next(iter(bad))):
            lnp.Constraints(latency=_TABLE, max_latency_ms=5.0, **bad)  # type: ignore[arg-type]


def test_a_check_times_at_the_tables_batch_size_cutting_or_repeating_the_batch() -> None:
    rows, other = torch.arange(3), torch.zeros(2)
    tiled = latency_module.at_batch_size((rows, other), 5)
    assert tiled[0].tolist() == [0, 1, 2, 0, 1] and tiled[1] is other  # only tensors of the batch's size change
    assert latency_module.at_batch_size(rows, 2).tolist() == [0, 1]
    assert latency_module.at_batch_size(rows, 3) is rows


def test_save_subnet_records_the_measured_latency_device_and_batch_size(tmp_path: Path) -> None:
    net = _supernet().freeze({"a": 1, "b": 0})
    folder = lnp.save_subnet(net, tmp_path / "best", torch.randn(5, 4), latency_repeats=3)
    saved = json.loads((folder / "architecture.json").read_text())
    assert saved["architecture"] == {"a": 1, "b": 0}
    assert saved["latency"]["ms"] > 0 and saved["latency"]["device"] == "cpu"
    assert saved["latency"]["batch_size"] == 5 and saved["latency"]["repeats"] == 3
    assert "latency" not in json.loads((lnp.save_subnet(net, tmp_path / "plain", torch.randn(5, 4))
                                        / "architecture.json").read_text())


# -- blocks whose choices sit deeper: per-label deltas ------------------------------------------------------------


def _nested_supernet() -> lnp.Supernet:
    """A block with two ChoiceBlocks inside an nn.Sequential (no label of its own), then a top-level choice."""
    torch.manual_seed(0)

    def mlp(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 32))

    return lnp.Supernet(nn.Linear(4, 32), nn.Sequential(
        lnp.ChoiceBlock([nn.Identity(), mlp(256), mlp(2048)], label="a"),
        lnp.ChoiceBlock([nn.Identity(), nn.Sequential(*[mlp(512) for _ in range(3)])], label="b")),
        lnp.ChoiceBlock([nn.Tanh(), mlp(1024)], label="c"), nn.Linear(32, 3))


def _every(supernet: lnp.Supernet) -> list[dict[str, int]]:
    labels = list(supernet.labels)
    out: list[dict[str, int]] = [{}]
    for label in labels:
        out = [{**a, label: k} for a in out for k in range(supernet.labels[label])]
    return out


def _by_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time a module as 1 ms plus 1 ms per 1000 parameters: deterministic, and larger choices cost more."""
    fake_latency_timing(monkeypatch, lambda module: 1.0 + sum(p.numel() for p in module.parameters()) / 1000)


def _cost(module: nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1000


def test_a_block_with_nested_choices_gets_per_label_deltas_and_predictions_add_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    supernet = _nested_supernet()
    _by_parameters(monkeypatch)
    table = lnp.LatencyTable.measure(supernet, torch.randn(8, 4), repeats=1)
    assert table.labels == (None, None, "c", None) and [len(row) for row in table.entries] == [1, 1, 2, 1]
    inner = supernet.blocks[1]
    a, b = inner[0].candidates, inner[1].candidates
    assert [label for label, _ in table.nested[1]] == ["a", "b"] and table.nested[0] == table.nested[2] == ()
    assert table.nested[1][0][1] == pytest.approx((0.0, _cost(a[1]), _cost(a[2])))
    assert table.nested[1][1][1] == pytest.approx((0.0, _cost(b[1])))
    assert table.entries[1] == (1.0,)  # the block at the reference subnet, as before
    predictions = set()
    for arch in _every(supernet):
        expected = ((table.entries[0][0] + table.entries[1][0] + table.entries[2][arch["c"]] + table.entries[3][0])
                    + (table.nested[1][0][1][arch["a"]] + table.nested[1][1][1][arch["b"]]))
        assert table.predict(arch) == expected and table.predict(arch, supernet) == expected
        predictions.add(round(table.predict(arch), 9))
    assert len(predictions) == len(_every(supernet))  # every architecture predicted apart
    table.check(supernet)


def test_elastic_layers_get_per_label_deltas_across_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    supernet = lnp.Supernet(lnp.ElasticLinear(4, [8, 64, 128], label="w"), nn.Sequential(
        lnp.ElasticLinear([8, 64, 128], 32, in_label="w"), nn.ReLU(),
        lnp.ElasticDepth([nn.Linear(32, 32) for _ in range(3)], label="d")), nn.Linear(32, 3))
    _by_parameters(monkeypatch)
    table = lnp.LatencyTable.measure(supernet, torch.randn(8, 4), repeats=1)
    assert table.labels == (None, None, None) and [len(row) for row in table.entries] == [1, 1, 1]
    # Block 1 reads "w" through its input width: it is timed on what it receives when block 0 takes "w" = k. Both
    # blocks read "w", a shared width: its deltas are taken around its middle choice (64), the others' around 0.
    assert table.nested[0] == (("w", pytest.approx((-56 * 5 / 1000, 0.0, 64 * 5 / 1000))),)
    assert [label for label, _ in table.nested[1]] == ["w", "d"] and table.nested[2] == ()
    assert table.nested[1][0][1] == pytest.approx((-56 * 32 / 1000, 0.0, 64 * 32 / 1000))
    assert table.nested[1][1][1] == pytest.approx((0.0, 32 * 33 / 1000, 2 * 32 * 33 / 1000))
    arch = {"w": 2, "d": 1}
    assert table.predict(arch) == (sum(row[0] for row in table.entries)
                                   + (table.nested[0][0][1][2] + table.nested[1][0][1][2] + table.nested[1][1][1][1]))


def test_unreached_nested_labels_contribute_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    inner = lnp.ChoiceBlock([nn.Identity(), nn.Linear(8, 8)], label="inner")
    supernet = lnp.Supernet(nn.Linear(4, 8), nn.Sequential(lnp.ChoiceBlock([inner, nn.Tanh()], label="outer")))
    _by_parameters(monkeypatch)
    table = lnp.LatencyTable.measure(supernet, torch.randn(8, 4), repeats=1)
    assert [label for label, _ in table.nested[1]] == ["outer", "inner"]
    assert table.predict({"outer": 1, "inner": 1}, supernet) == table.predict({"outer": 1, "inner": 0})
    assert table.predict({"outer": 0, "inner": 1}, supernet) == table.predict({"outer": 0, "inner": 1})


def test_nested_deltas_round_trip_and_a_table_saved_before_them_loads(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    supernet = _nested_supernet()
    _by_parameters(monkeypatch)
    table = lnp.LatencyTable.measure(supernet, torch.randn(8, 4), repeats=1)
    assert table.nested and lnp.LatencyTable.load(table.save(tmp_path / "t.json")) == table
    old = json.loads((tmp_path / "t.json").read_text())
    del old["nested"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = lnp.LatencyTable.load(tmp_path / "old.json")
    assert loaded.nested == () and loaded.entries == table.entries
    loaded.check(supernet)  # no deltas: checked on its entries, predictions as before
    assert loaded.predict({"a": 2, "b": 1, "c": 1}) == sum(row[0] for row in table.entries[:2]) + table.entries[2][
        1] + table.entries[3][0]
    # A space without nested labels saves no "nested" key, as before.
    flat = lnp.LatencyTable.measure(_supernet(), torch.randn(8, 4), repeats=1)
    assert flat.nested == () and "nested" not in json.loads(flat.save(tmp_path / "flat.json").read_text())
    # Other nested labels: refused.
    other = lnp.LatencyTable(table.entries, table.labels, table.device, table.batch_size,
                             ((), (("a", (0.0, 1.0, 2.0)),), (), ()))
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet"):
        other.check(supernet)


def test_fastest_and_slowest_bound_every_nested_prediction() -> None:
    supernet = _nested_supernet()
    table = lnp.LatencyTable.measure(supernet, torch.randn(8, 4), repeats=2)
    # Noise can make some deltas negative: the bounds must still hold, whatever their signs.
    tables = [table, lnp.LatencyTable(table.entries, table.labels, table.device, table.batch_size,
                                      ((), (("a", (0.0, -0.3, 0.7)), ("b", (0.0, 0.2))), (), ()))]
    for t in tables:
        predictions = [t.predict(arch, supernet) for arch in _every(supernet)]
        assert t.fastest_ms() <= min(predictions) and max(predictions) <= t.slowest_ms()
    model = _Net()
    model.supernet = supernet
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    budget = min(table.predict(arch) for arch in _every(supernet))
    # The budget sits exactly at a prediction, where timing noise would decide the end-to-end check of the best
    # (test_a_budgeted_search_never_returns_...'s subject): checked off here.
    result = lnp.search(None, model, lnp.GridSearch(), data,
                        constraints=lnp.Constraints(latency=table, max_latency_ms=budget, check_top=0))
    assert result.history and all(table.predict(r.architecture) <= budget for r in result.history)
    with pytest.raises(lnp.NASPipeConfigError, match="no architecture can meet it"):
        lnp.search(None, model, lnp.GridSearch(), data, latency=table, max_latency_ms=table.fastest_ms() * 0.99)


def test_the_cli_export_times_the_best_subnet_at_the_latency_tables_batch_size(tmp_path: Path) -> None:
    from lightning_naspipe.integration.cli import _export

    model = _Net()
    result = lnp.SearchResult([lnp.Record(0, {"a": 1, "b": 0}, 1.0, 10, 100)], maximize=False)

    class Loaders:
        def __init__(self, size: int) -> None:
            self.size = size

        def val_dataloader(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(torch.randn(self.size, 4), torch.randint(0, 3, (self.size,)))]

    def recorded(folder: Path) -> Any:
        return json.loads((folder / "architecture.json").read_text())["latency"]["batch_size"]

    # The validation batch (64) is cut to the table's batch size (32): the latency compares with its predictions.
    assert recorded(_export(model, result, Loaders(64), None, str(tmp_path / "a"), 1, 32)) == 32
    assert recorded(_export(model, result, Loaders(64), None, str(tmp_path / "b"), 1)) == 64  # no table: as given
    with pytest.warns(UserWarning, match="holds 16 samples, fewer than the latency table's batch size 32"):
        assert recorded(_export(model, result, Loaders(16), None, str(tmp_path / "c"), 1, 32)) == 16
