"""lnp.search on one process: exact scores, untouched supernet, resumable log, constraints, loggers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import CLASSES, FEATURES, ToyNet, full_state, pl, toy_loader, train
from lightning_naspipe.searching import search_loop
from test_searchers import nested_blocks


@pytest.fixture(scope="module")
def trained() -> tuple[Any, Any]:
    return train(max_epochs=1)


def _by_hand(model: Any, architecture: dict[str, int], loader: Any) -> float:
    model.supernet.eval()
    with torch.no_grad():
        losses = [float(model.compute_loss(model.supernet(x, architecture), (x, y))) for x, y in loader]
    model.supernet.train()
    return sum(losses) / len(losses)


def test_scores_are_the_mean_loss_and_the_best_is_the_lowest(trained: tuple[Any, Any]) -> None:
    model, trainer = trained
    loader = toy_loader(samples=40, shuffle=False)
    result = lnp.search(trainer, model, lnp.RandomSearch(7, seed=2), loader)
    assert [r.index for r in result.history] == list(range(7))
    for record in result.history:
        assert record.score == _by_hand(model, record.architecture, loader)
        frozen = model.supernet.freeze(record.architecture)
        assert record.params == sum(p.numel() for p in frozen.parameters()) and record.flops > 0
    assert result.best == min(result.history, key=lambda r: (r.score, r.index)).architecture
    assert not result.maximize and "architecture" in result.table()
    again = lnp.search(trainer, model, lnp.RandomSearch(7, seed=2), loader)
    assert again.history == result.history


def test_search_leaves_the_supernet_the_optimizer_and_the_rng_untouched(trained: tuple[Any, Any]) -> None:
    model, trainer = trained
    before, rng = full_state(model, trainer), torch.get_rng_state()
    training = model.supernet.training
    lnp.search(trainer, model, lnp.EvolutionSearch(4, 2, 4, seed=1), toy_loader(samples=24, shuffle=False),
               calibration=toy_loader(samples=16, shuffle=False))
    after = full_state(model, trainer)
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert torch.equal(rng, torch.get_rng_state()) and model.supernet.training == training


def test_calibration_recomputes_batchnorm_statistics_per_candidate(trained: tuple[Any, Any]) -> None:
    model, trainer = trained
    loader, calibration = toy_loader(samples=24, shuffle=False), toy_loader(samples=16, shuffle=False)
    bn_arch = {label: 0 for label in model.supernet.labels}  # "shared" 0: the BatchNorm1d candidate
    only = _Fixed([bn_arch])
    plain = lnp.search(trainer, model, only, loader).history[0].score
    calibrated = lnp.search(trainer, model, only, loader, calibration=calibration).history[0].score
    frozen = lnp.recalibrate_batchnorm(model.supernet.freeze(bn_arch), [x for x, _ in calibration]).eval()
    with torch.no_grad():
        by_hand = [float(model.compute_loss(frozen(x), (x, y))) for x, y in loader]
    assert calibrated == sum(by_hand) / len(by_hand) and calibrated != plain


class _Fixed:
    """A searcher that evaluates given architectures once."""

    def __init__(self, architectures: list[dict[str, int]]) -> None:
        self.architectures = architectures

    def propose(self, labels: Any, history: Any, feasible: Any, maximize: bool) -> list[dict[str, int]]:
        return [] if history else list(self.architectures)


def test_a_resumed_search_equals_the_uninterrupted_one_and_evaluates_nothing_twice(
        trained: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, trainer = trained
    loader = toy_loader(samples=24, shuffle=False)
    searcher = lnp.EvolutionSearch(population=5, sample_size=2, cycles=7, seed=4)
    full = lnp.search(trainer, model, searcher, loader, log_path=tmp_path / "full.jsonl")
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    # The header, then one record per evaluation: all 9 architectures of the toy space (7 cycles would
    # need 12; the evolution ends when every mutation repeats an architecture evaluated before).
    assert len(lines) == 1 + 9 and "fingerprint" in lines[0]
    # Killed after 6 records, halfway through writing the 7th.
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[:7]) + "\n" + lines[7][:20])
    evaluated: list[dict[str, int]] = []
    score = search_loop._Scorer.__call__
    monkeypatch.setattr(search_loop._Scorer, "__call__",
                        lambda self, a: evaluated.append(a) or score(self, a))
    resumed = lnp.search(trainer, model, searcher, loader, log_path=tmp_path / "cut.jsonl")
    assert resumed.history == full.history
    fresh = {json.dumps(r.architecture, sort_keys=True) for r in full.history[6:]}
    previous = {json.dumps(r.architecture, sort_keys=True) for r in full.history[:6]}
    assert len(evaluated) == len(fresh - previous)
    assert (tmp_path / "cut.jsonl").read_text().splitlines() == lines


def test_a_log_written_for_other_weights_data_or_settings_is_refused(trained: tuple[Any, Any],
                                                                     tmp_path: Path) -> None:
    model, trainer = trained
    loader = toy_loader(samples=24, shuffle=False)
    searcher = lnp.RandomSearch(4, seed=1)
    log = tmp_path / "search.jsonl"
    first = lnp.search(trainer, model, searcher, loader, log_path=log)
    assert lnp.search(trainer, model, searcher, loader, log_path=log).history == first.history  # same: resumed
    others = {"seed": dict(searcher=lnp.RandomSearch(4, seed=2)),
              "data": dict(dataloader=toy_loader(samples=16, shuffle=False)),
              "constraint": dict(max_params=10**9)}
    for what, change in others.items():
        arguments: dict[str, Any] = dict(searcher=searcher, dataloader=loader, log_path=log) | change
        with pytest.raises(lnp.NASPipeConfigError, match="written for other weights"):
            lnp.search(trainer, model, **arguments)
    changed = ToyNet()
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        next(changed.supernet.parameters()).view(-1)[0] += 1e-6  # one weight, one ulp-ish step
    with pytest.raises(lnp.NASPipeConfigError, match="written for other weights"):
        lnp.search(trainer, changed, searcher, loader, log_path=log)
    assert log.read_text().count("\n") == 1 + 4  # nothing appended by the refused searches


class _Accuracy(ToyNet):  # type: ignore[misc, valid-type]
    def search_metric(self, output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, int]:
        return (output.argmax(-1) == batch[1]).sum(), len(batch[1])


def test_a_metric_method_gives_exact_ratios_and_higher_is_better(trained: tuple[Any, Any]) -> None:
    model, trainer = trained
    scorer = _Accuracy()
    scorer.load_state_dict(model.state_dict())
    loader = toy_loader(samples=40, shuffle=False)
    result = lnp.search(trainer, scorer, lnp.RandomSearch(8, seed=1), loader)
    assert result.maximize
    scorer.supernet.eval()
    for record in result.history:
        with torch.no_grad():
            correct = sum(int((scorer.supernet(x, record.architecture).argmax(-1) == y).sum()) for x, y in loader)
        assert record.score == correct / 40
    assert result.best_record.score == max(r.score for r in result.history)


def test_constraints_bound_params_and_flops_and_loggers_get_the_curve(trained: tuple[Any, Any],
                                                                      tmp_path: Path) -> None:
    model, _ = trained
    logger = pl.loggers.CSVLogger(tmp_path, name="", version="")
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False)
    loader = toy_loader(samples=16, shuffle=False)
    unbounded = lnp.search(trainer, model, lnp.GridSearch(), loader)
    limit = sorted(r.params for r in unbounded.history)[5]
    bounded = lnp.search(trainer, model, lnp.RandomSearch(3, seed=0), loader, max_params=limit,
                         max_flops=10**9, constraint=lambda arch, params, flops: arch["shared"] != 2)
    assert all(r.params <= limit and r.architecture["shared"] != 2 for r in bounded.history)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert "search/score" in rows[0] and "search/best_score" in rows[0] and len(rows) == 1 + 9 + 3
    # Refused up front, from the space: the smallest subnet's size is named.
    with pytest.raises(lnp.NASPipeConfigError, match=r"max_params=1\): no architecture of this space has at most 1 "):
        lnp.search(trainer, model, lnp.RandomSearch(3), loader, max_params=1)
    with pytest.raises(lnp.NASPipeConfigError, match="empty dataloader"):
        lnp.search(trainer, model, lnp.RandomSearch(3), [])


def test_the_progress_bar_counts_architectures_when_the_trainer_shows_one(
        trained: tuple[Any, Any], capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = trained
    loader = toy_loader(samples=8, shuffle=False)
    lnp.search(pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=True), model,
               lnp.RandomSearch(5), loader)
    shown = capsys.readouterr().err
    assert "Search" in shown and "5 architectures" in shown
    lnp.search(pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False), model,
               lnp.RandomSearch(5), loader)
    assert "Search" not in capsys.readouterr().err


def test_a_multi_stage_trainer_whose_processes_never_started_is_refused(trained: tuple[Any, Any]) -> None:
    model, _ = trained
    loader = toy_loader(samples=8, shuffle=False)
    unlaunched = pl.Trainer(accelerator="cpu", devices=2, strategy="naspipe", logger=False)
    with pytest.raises(lnp.NASPipeConfigError, match=r"not running.*trainer\.validate.*one-device Trainer"):
        lnp.search(unlaunched, model, lnp.RandomSearch(2), loader)
    alone = lnp.search(None, model, lnp.RandomSearch(2), loader).history
    one_stage = pl.Trainer(accelerator="cpu", devices=1, strategy="naspipe", logger=False, enable_progress_bar=False)
    assert lnp.search(one_stage, model, lnp.RandomSearch(2), loader).history == alone


class _Nested(ToyNet):  # type: ignore[misc, valid-type]
    """ToyNet's stem and head around blocks whose labels a path does not always reach."""

    def __init__(self) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(torch.nn.Linear(FEATURES, 8), *nested_blocks(8), torch.nn.Linear(8, CLASSES))


def test_architectures_that_differ_only_where_never_reached_are_evaluated_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, loader = _Nested(), toy_loader(samples=16, shuffle=False)
    evaluated: list[dict[str, int]] = []
    score = search_loop._Scorer.__call__
    monkeypatch.setattr(search_loop._Scorer, "__call__", lambda self, a: evaluated.append(a) or score(self, a))
    grid = lnp.search(None, model, lnp.GridSearch(), loader)
    assert len(grid.history) == len(evaluated) == 80  # of 144 architectures
    unreached = {"outer": 0, "inner": 2, "gate": 0, "gated": 1, "tail": 0, "last": 1}
    canonical = model.supernet.canonical(unreached)
    # A searcher of the user's own proposes both: recorded as proposed, scored once.
    evaluated.clear()
    both = lnp.search(None, model, _Fixed([unreached, canonical]), loader).history
    assert len(evaluated) == 1 and [r.architecture for r in both] == [unreached, canonical]
    assert both[0].score == both[1].score == next(r.score for r in grid.history if r.architecture == canonical)
