from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.integration.loop_state import check_loop_state_layout, reopen_epoch


def _stopped_checkpoint(namespace: Any, tmp_path: Path) -> dict[str, Any]:
    import lightning_naspipe as lnp
    from helpers import train

    _, trainer = train(lnp.NASPipeStrategy(window=4), namespace=namespace, max_steps=5, max_epochs=2)
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    return dict(torch.load(tmp_path / "stop.ckpt", weights_only=False))


@pytest.mark.parametrize("namespace_name", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_keeps_the_loop_state_layout_exact_resume_rewrites(namespace_name: str, tmp_path: Path) -> None:
    # If this fails, the installed Lightning changed its private loop-state layout: reopen_epoch and
    # LOOP_STATE_LAYOUT need updating for it (the error names the version).
    from helpers import NAMESPACES

    checkpoint = _stopped_checkpoint(NAMESPACES[namespace_name], tmp_path)
    check_loop_state_layout(checkpoint)
    assert checkpoint["naspipe"]["data"]["position"] == 5


def test_changed_loop_state_layout_fails_loudly_naming_the_version() -> None:
    checkpoint = {"pytorch-lightning_version": "9.9.9", "loops": {"fit_loop": {
        "epoch_progress": {"total": {}, "current": {}}}}}
    with pytest.raises(NASPipeConfigError, match=r"Lightning 9\.9\.9 .*epoch_progress.*'total'.*lightning>=2\.6,<2\.7"):
        reopen_epoch(checkpoint, 0)


def test_the_dependency_bounds_the_refusal_and_the_installed_versions_agree() -> None:
    import inspect
    import re

    from packaging.version import Version

    from lightning_naspipe.compat.lightning import SUPPORTED
    from lightning_naspipe.integration import loop_state
    from lightning_naspipe.namespaces import installed

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    bounds = dict((name, (low, high)) for name, low, high in
                  re.findall(r'"(lightning|pytorch-lightning)>=([\d.]+),<([\d.]+)"', pyproject))
    assert set(bounds) == {"lightning", "pytorch-lightning"}, "pyproject bounds both Lightning packages"
    assert "SUPPORTED" in inspect.getsource(loop_state), "loop_state's refusal names compat.lightning.SUPPORTED"
    for name, (low, high) in bounds.items():
        assert f"{name}>={low},<{high}" in SUPPORTED, f"the refusals should tell users to install {name}<{high}"
    for namespace in installed():  # the suite runs inside the bounds it states
        low, high = bounds["lightning" if namespace.name == "lightning.pytorch" else "pytorch-lightning"]
        assert Version(low) <= Version(namespace.version) < Version(high), (namespace.name, namespace.version)


@pytest.mark.parametrize("namespace_name", ["lightning.pytorch", "pytorch_lightning"])
def test_reopen_epoch_gives_the_counters_lightning_resumes_inside_an_epoch_from(namespace_name: str,
                                                                                 tmp_path: Path) -> None:
    # The rewrite's meaning, not only its keys: Lightning's own checkpoint where max_steps stopped inside an epoch,
    # rewritten by reopen_epoch, holds the counters of Lightning's own checkpoint written at that step's
    # on_train_batch_end (the state it resumes inside the epoch from). Plain Trainer, in process.
    from helpers import NAMESPACES, train

    from lightning_naspipe.compat.lightning import LOGGER_STEP_KEY

    ns = NAMESPACES[namespace_name]
    _, trainer = train(namespace=ns, max_steps=5)  # 12 batches per epoch
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    stopped = dict(torch.load(tmp_path / "stop.ckpt", weights_only=False))

    class SaveAtStep5(ns.Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 5:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    train(namespace=ns, max_steps=7, callbacks=[SaveAtStep5()])
    mid = torch.load(tmp_path / "mid.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert stopped["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1, "Lightning closed epoch 0"
    reopen_epoch(stopped, 0)
    rewritten = stopped["loops"]["fit_loop"]
    for key in ("epoch_progress", "epoch_loop.batch_progress"):
        assert rewritten[key] == mid[key], key
    assert rewritten["epoch_loop.state_dict"][LOGGER_STEP_KEY] == mid["epoch_loop.state_dict"][LOGGER_STEP_KEY] == 4
    assert stopped["epoch"] == 0
