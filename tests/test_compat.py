"""compat.lightning's setup guard: every private Lightning API checked at ``NASPipeStrategy.setup``, a missing
one refused by name with the installed version and the supported range (faked away here, in process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_naspipe.compat.lightning import SUPPORTED, check_internals, require_internals
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import Namespace, installed

NAMESPACES = [pytest.param(ns, id=ns.name) for ns in installed()]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_the_installed_lightning_has_every_internal(ns: Namespace) -> None:
    assert check_internals(ns) == []
    require_internals(ns)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_a_missing_internal_is_named_with_the_version_and_the_range(ns: Namespace,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(ns.pytorch.callbacks.LearningRateMonitor, "_extract_stats")
    assert check_internals(ns) == ["LearningRateMonitor._extract_stats"]
    with pytest.raises(NASPipeConfigError) as raised:
        require_internals(ns)
    message = str(raised.value)
    assert "LearningRateMonitor._extract_stats" in message and f"{ns.name} {ns.version}" in message
    assert SUPPORTED in message and "lightning>=2.6,<2.7" in message


@pytest.mark.parametrize("ns", NAMESPACES)
def test_a_changed_signature_counts_as_missing(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    precision = ns.pytorch.plugins.precision.Precision
    monkeypatch.setattr(precision, "_clip_gradients", lambda self, model, optimizer, clip_value: None)
    assert check_internals(ns) == ["Precision._clip_gradients"]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_an_attribute_init_no_longer_sets_counts_as_missing(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = ns.pytorch_module("loops.training_epoch_loop")._TrainingEpochLoop
    init = loop.__init__

    def moved(self: object, *args: object, **kwargs: object) -> None:  # sets its attributes elsewhere
        init(self, *args, **kwargs)

    monkeypatch.setattr(loop, "__init__", moved)
    assert check_internals(ns) == ["_TrainingEpochLoop._batches_that_stepped", "_TrainingEpochLoop._results"]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_setup_refuses_a_run_before_training(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_naspipe as lnp
    from helpers import NAMESPACES as MODULES
    from helpers import train

    loop = ns.pytorch_module("loops.training_epoch_loop")._TrainingEpochLoop
    monkeypatch.delattr(loop, "_should_check_val_epoch")
    trained = []
    monkeypatch.setattr(lnp.NASPipeMixin, "training_step", lambda *args, **kwargs: trained.append(1))
    expected = rf"_TrainingEpochLoop\._should_check_val_epoch.*{re.escape(SUPPORTED)}"
    with pytest.raises(NASPipeConfigError, match=expected):
        train(lnp.NASPipeStrategy(window=2), namespace=MODULES[ns.name], max_steps=2)
    assert trained == []


def test_the_range_agrees_with_pyproject_readme_and_design() -> None:
    root = Path(__file__).resolve().parent.parent
    pyproject = (root / "pyproject.toml").read_text()
    for package in ("lightning", "pytorch-lightning"):
        assert f'"{package}>={SUPPORTED.split(">=")[1].split(",")[0]},<' in pyproject
        assert re.search(rf'"{package}>=[\d.]+,<[\d.]+"', pyproject)
    bounds = set(re.findall(r'"(?:lightning|pytorch-lightning)>=([\d.]+),<([\d.]+)"', pyproject))
    assert len(bounds) == 1, f"lightning and pytorch-lightning are bounded alike: {bounds}"
    ((low, high),) = bounds
    assert SUPPORTED == f"lightning>={low},<{high} (or pytorch-lightning>={low},<{high})"
    design = (root / "docs" / "design.md").read_text()
    assert f"`lightning>={low},<{high}`" in design and f"`pytorch-lightning>={low},<{high}`" in design
    ci = (root / ".ci" / "oldest").read_text()
    assert f"lightning=={low}.0" in ci and f"pytorch-lightning=={low}.0" in ci, "CI's second combination: the oldest"
    torch_low = re.search(r'"torch>=([\d.]+)"', pyproject)
    assert torch_low is not None and f"torch=={torch_low.group(1)}.0" in (root / "README.md").read_text()
