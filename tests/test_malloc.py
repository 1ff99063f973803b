"""compat/malloc.py: glibc's malloc keeps freed memory while modules are timed on the CPU (fresh processes: the setting
is per process and lasts)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from lightning_naspipe.compat import malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# One MobileNet-style block (1x1 expand to 144 channels, 5x5 depthwise, 1x1 project) at batch 32 on 32x32: its
# activations are megabytes, which glibc's defaults page-fault in anew on every run.
_PROBE = """
import json, resource, sys, torch
from torch import nn
from lightning_naspipe.searching.timing import time_module
torch.set_num_threads(1)
net = nn.Sequential(nn.Conv2d(24, 144, 1), nn.ReLU(), nn.Conv2d(144, 144, 5, padding=2, groups=144), nn.ReLU(),
                    nn.Conv2d(144, 24, 1)).eval()
x = torch.randn(32, 24, 32, 32)
time_module(net, x, repeats=3)  # the timing entry point sets malloc up, then warms up
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
with torch.no_grad():
    for _ in range(10):
        net(x)
from lightning_naspipe.compat import malloc
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10,
                  "kept": malloc.keep_freed_memory()}))
"""


def _probe(**env: str) -> dict[str, float]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in (malloc.ENV, "GLIBC_TUNABLES", "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def mallopt_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A fresh process's state, ``mallopt`` recorded instead of called (it succeeds)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(malloc, "_kept", None)
    monkeypatch.setattr(malloc, "_set", lambda option, value: calls.append((option, value)) or True)
    return calls


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_timing_on_the_cpu_keeps_freed_memory_so_runs_do_not_page_fault() -> None:
    kept, default = _probe(), _probe(**{malloc.ENV: "default"})
    assert kept["kept"] and not default["kept"]
    # glibc's defaults map every run's activations anew (~27,000 faults a run here); kept, the runs reuse them.
    assert default["faults"] > 1000, default
    assert kept["faults"] < 50, kept


@pytest.mark.parametrize("env", [{malloc.ENV: "default"}, {malloc.ENV: " Default "},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_users_own_allocator_settings_are_left_alone(env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                     mallopt_calls: list[tuple[int, int]]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert malloc.keep_freed_memory() is False
    assert mallopt_calls == []


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_set_once_per_process_both_thresholds(monkeypatch: pytest.MonkeyPatch,
                                               mallopt_calls: list[tuple[int, int]]) -> None:
    for name in (malloc.ENV, "LD_PRELOAD", "GLIBC_TUNABLES", *[k for k in os.environ if k.startswith("MALLOC_")]):
        monkeypatch.delenv(name, raising=False)
    assert malloc.keep_freed_memory() and malloc.keep_freed_memory()
    assert mallopt_calls == [(-3, malloc.MMAP_THRESHOLD), (-1, malloc.TRIM_THRESHOLD)]


def test_a_failed_mallopt_says_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "_kept", None)
    monkeypatch.setattr(malloc, "_applies", lambda: True)
    monkeypatch.setattr(malloc, "_set", lambda option, value: False)
    assert malloc.keep_freed_memory() is False
