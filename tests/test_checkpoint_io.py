"""Crash-safe checkpoint writes: a checkpoint path holds the old file or the new one, never part of one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch

import lightning_naspipe as lnp
from helpers import train
from lightning_naspipe.integration.checkpoint_io import atomic_save, atomic_write


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_atomic_save_writes_a_loadable_file_and_nothing_else(tmp_path: Path) -> None:
    atomic_save({"w": torch.arange(4)}, tmp_path / "sub" / "a.ckpt")
    assert torch.equal(torch.load(tmp_path / "sub" / "a.ckpt")["w"], torch.arange(4))
    assert _leftovers(tmp_path / "sub") == []


def test_atomic_write_writes_any_bytes_and_leaves_nothing_else(tmp_path: Path) -> None:
    atomic_write(tmp_path / "a.json", lambda file: file.write(b"{}") and None)
    atomic_write(tmp_path / "a.json", lambda file: file.write(b"[1]") and None)
    assert (tmp_path / "a.json").read_bytes() == b"[1]" and _leftovers(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "last.ckpt"
    atomic_save({"version": 1}, target)

    def dies_half_way(obj: Any, file: Any) -> None:
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"version": 2}, target)
    monkeypatch.undo()
    assert torch.load(target)["version"] == 1 and _leftovers(tmp_path) == []


def test_the_next_write_removes_what_a_killed_write_left(tmp_path: Path) -> None:
    (tmp_path / ".last.ckpt.abc123.naspipe-partial").write_bytes(b"x" * 100)
    (tmp_path / ".other.ckpt.abc123.naspipe-partial").write_bytes(b"x")  # another checkpoint's: kept
    atomic_save({"version": 1}, tmp_path / "last.ckpt")
    assert _leftovers(tmp_path) == [".other.ckpt.abc123.naspipe-partial"]


WRITER = """
import sys, torch
from lightning_naspipe.integration.checkpoint_io import atomic_save, atomic_write
big = torch.zeros(8_000_000)  # 32 MB: a write takes long enough to be killed inside it
version = 0
while True:
    version += 1
    big[0] = version
    atomic_save({"big": big}, sys.argv[1])
    print(version, flush=True)
"""


@pytest.mark.slow
def test_kill_during_writes_never_leaves_a_truncated_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    for delay in (0.0, 0.2, 0.4):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None and writer.stdout.readline().strip()  # one whole version written
        time.sleep(delay)  # then killed inside a later write, at different points of it
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert torch.load(target)["big"].numel() == 8_000_000  # the old or the new version, whole
    atomic_save({"done": True}, target)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("namespace", [pytest.param(L, id="lightning.pytorch"),
                                       pytest.param(pl, id="pytorch_lightning")])
def test_strategy_saves_crash_safe_by_default_and_keeps_a_users_io(namespace: Any, tmp_path: Path) -> None:
    _, trainer = train(lnp.NASPipeStrategy(window=4), namespace=namespace, max_steps=4)
    assert type(trainer.strategy.checkpoint_io).__name__.endswith("AtomicCheckpointIO")
    assert isinstance(trainer.strategy.checkpoint_io, namespace.plugins.TorchCheckpointIO)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert torch.load(tmp_path / "a.ckpt", weights_only=False)["global_step"] == 4 and _leftovers(tmp_path) == []

    own = namespace.plugins.TorchCheckpointIO()
    _, trainer = train(lnp.NASPipeStrategy(window=4), namespace=namespace, max_steps=4, plugins=[own])
    assert trainer.strategy.checkpoint_io is own
