"""The start-up cache on disk: where it lives, what its key depends on, and files it cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.integration import profile_cache
from lightning_naspipe.integration.profile_cache import ENV, cache_dir, load, measurement_key, store

CPU = torch.device("cpu")


def _net(kernel: int = 3, candidates: int = 2, label: str | None = None) -> lnp.Supernet:
    return lnp.Supernet(nn.Conv2d(3, 4, 3, padding=1),
                        lnp.ChoiceBlock([nn.Conv2d(4, 4, kernel, padding=kernel // 2) for _ in range(candidates)],
                                        label=label),
                        nn.Flatten(), nn.Linear(4 * 8 * 8, 2))


def _key(net: nn.Module | None = None, example: Any = None, processes: int = 2) -> dict[str, Any]:
    return measurement_key("profile", profile_cache.structure_digest(net if net is not None else _net()),
                           example if example is not None else torch.zeros(4, 3, 8, 8), CPU, processes)


def test_the_folder_is_the_variable_else_xdg_else_home_and_0_turns_it_off(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(ENV, "0")
    assert cache_dir() is None
    monkeypatch.setenv(ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lightning_naspipe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lightning_naspipe"


def test_a_stored_value_loads_under_its_key_only_and_the_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    key = _key()
    assert load(key, lambda value: value) is None  # a miss
    store(key, {"weights": [0.5, 1.5]})
    assert load(key, lambda value: value) == {"weights": [0.5, 1.5]}
    assert load(_key(processes=4), lambda value: value) is None
    files = list(Path(os.environ[ENV]).iterdir())
    assert [f.name.startswith("profile-") and f.suffix == ".json" for f in files] == [True]
    assert json.loads(files[0].read_text())["key"] == key  # readable: the key in full, then the value


def test_the_cache_turned_off_neither_reads_nor_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    folder = Path(os.environ[ENV])
    store(_key(), [1.0])
    monkeypatch.setenv(ENV, "0")
    assert load(_key(), lambda value: value) is None
    store(_key(processes=3), [2.0])
    assert len(list(folder.iterdir())) == 1


def test_the_key_follows_structure_shapes_device_and_threads_not_weight_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    net = _net()
    key = _key(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # trained weights: the same space
    assert _key(net) == key == _key(_net())
    frozen = _net()
    frozen.blocks[0].weight.requires_grad_(False)
    others = [_net(kernel=5), _net(candidates=3), _net(label="op"), frozen]
    assert all(_key(other)["space"] != key["space"] for other in others)
    assert _key(example=torch.zeros(2, 3, 8, 8)) != key  # another micro-batch
    assert _key(example=torch.zeros(4, 3, 8, 8, dtype=torch.float64)) != key
    assert _key(processes=3) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert _key() != key
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(profile_cache, "_cpu_model", lambda: "another CPU")
    assert _key() != key
    assert profile_cache.device_name(CPU).startswith("cpu another CPU x")


class _Edited(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _Original(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 2


def test_editing_a_modules_code_changes_the_space() -> None:
    _Edited.__qualname__ = _Original.__qualname__  # the same name, another forward
    _Edited.__module__ = _Original.__module__
    first = profile_cache.structure_digest(lnp.Supernet(_Original()))
    assert profile_cache.structure_digest(lnp.Supernet(_Edited())) != first
    assert profile_cache.structure_digest(lnp.Supernet(_Original())) == first


_HASH_SCRIPT = """
import torch
from torch import nn
import lightning_naspipe as lnp
from lightning_naspipe.integration.profile_cache import structure_digest
class Block(nn.Module):
    def forward(self, x):
        return x if self.training in {"never", "a", "b", "c", "d", "e", "f"} else -x
print(structure_digest(lnp.Supernet(Block(), nn.Linear(2, 2))))
"""


@pytest.mark.multiprocess  # stage processes in a module of another kind
@pytest.mark.slow
def test_the_fingerprint_is_the_same_in_every_process() -> None:
    """String hashing changes per process (a frozenset's order): a rerun must still find its entry."""
    prints = {subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True, timeout=120).stdout for seed in ("1", "2")}
    assert len(prints) == 1


def test_an_unreadable_file_is_ignored_with_a_warning_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    store(key, [1.0])
    path = next(Path(os.environ[ENV]).iterdir())
    for bad in ("{not json", json.dumps({"value": [1.0]}), json.dumps({"key": _key(processes=5), "value": [1.0]})):
        path.write_text(bad)
        with pytest.warns(UserWarning, match="ignoring the unreadable start-up cache file"):
            assert load(key, lambda value: value) is None
    store(key, [2.0])
    assert load(key, lambda value: value) == [2.0]

    def refuses(value: Any) -> list[float]:
        raise ValueError("not one weight per block")

    with pytest.warns(UserWarning, match="not one weight per block"):
        assert load(key, refuses) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(key, lambda value: None) is None  # an entry this run cannot use: no warning


def test_a_folder_that_cannot_be_written_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(ENV, str(blocker / "cache"))  # a folder inside a file
    with pytest.warns(UserWarning, match="cannot write the start-up cache"):
        store(_key(), [1.0])
    with pytest.warns(UserWarning, match="cannot read the start-up cache file"):
        assert load(_key(), lambda value: value) is None


def test_a_lazy_module_has_a_fingerprint_before_its_first_forward() -> None:
    lazy = lnp.Supernet(nn.LazyLinear(3))
    before = profile_cache.structure_digest(lazy)
    lazy.blocks[0](torch.zeros(2, 5))
    assert len(before) == 64 and profile_cache.structure_digest(lazy) != before
