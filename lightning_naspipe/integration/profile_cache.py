"""The disk cache of what a run measures at its start (the space's profile, the timed split's block weights), so
that reruns and resumes skip the measuring.

An entry is keyed by everything the numbers depend on (:func:`measurement_key`): the space's structure
(:func:`structure_digest`: every module's class, its code and settings, every parameter's and buffer's name, shape,
dtype and whether it trains, the labels; not the weights), the device (:func:`device_name`: CPU model or CUDA device
name), torch's version, the CPU threads per process, the processes measuring at once, the example input's shapes and
dtypes, what was measured and :data:`FORMAT`. Folder: ``$LIGHTNING_NASPIPE_CACHE``, else
``$XDG_CACHE_HOME/lightning_naspipe``, else ``~/.cache/lightning_naspipe``; ``LIGHTNING_NASPIPE_CACHE=0`` turns the
cache off. One JSON file per key, written atomically (a temporary file renamed over it); a file that cannot be read
or parsed is ignored with a warning and measured again, a folder that cannot be written to only warns.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_naspipe.integration.checkpoint_io import atomic_write
from lightning_naspipe.space.boundary import tensors_in

__all__ = ["ENV", "FORMAT", "cache_dir", "device_name", "load", "measurement_key", "store", "structure_digest"]

#: The environment variable naming the cache folder (``0``: no cache).
ENV = "LIGHTNING_NASPIPE_CACHE"
#: The entries' format; raised whenever the files or what is measured change, so that old entries are not read.
FORMAT = 3

T = TypeVar("T")


def cache_dir() -> Path | None:
    """The cache folder (see the module's docstring); ``None`` when ``LIGHTNING_NASPIPE_CACHE=0``."""
    chosen = os.environ.get(ENV, "")
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_naspipe"


def structure_digest(supernet: nn.Module) -> str:
    """A hash of ``supernet``'s structure: each module's name, class (and its code, so that an edited ``forward``
    counts), settings (``extra_repr``), label and elastic dimensions, each parameter's and buffer's name, shape, dtype
    and ``requires_grad``, and the supernet's labels; not the values of the weights."""
    sources: dict[type, str] = {}
    lines = [repr(getattr(supernet, "labels", None))]
    for name, module in supernet.named_modules():
        kind = type(module)
        if kind not in sources:
            sources[kind] = _code(kind)
        lines.append(f"{name} {kind.__module__}.{kind.__qualname__} {sources[kind]} ({module.extra_repr()}) "
                     f"{getattr(module, 'label', None)!r} {getattr(module, 'dims', None)!r}")
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        lines += [f" {n} {type(t).__name__} {'lazy' if is_lazy(t) else tuple(t.shape)} {t.dtype} {t.requires_grad}"
                  for n, t in own]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _code(kind: type) -> str:
    """A digest of the code of the functions ``kind`` and its bases define, but torch's (whose version is in the
    key): an edited ``forward`` is another space."""
    digest = hashlib.sha256()
    for cls in kind.__mro__:
        if cls is not object and not cls.__module__.startswith("torch"):
            for _, attribute in sorted(vars(cls).items()):
                code = getattr(getattr(attribute, "__func__", attribute), "__code__", None)
                if isinstance(code, types.CodeType):
                    _add_code(digest, code)
    return digest.hexdigest()[:16]


def _add_code(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code + repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _add_code(digest, const)
        else:  # a frozenset's order changes with the process's string hashing
            digest.update(repr(sorted(map(repr, const)) if isinstance(const, frozenset) else const).encode())


def device_name(device: torch.device) -> str:
    """What a timing on ``device`` depends on: its type and model, e.g. ``"cuda NVIDIA H100 80GB HBM3"`` or
    ``"cpu AMD EPYC 7B13 x16"`` (the CPU's model and its logical cores)."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu {_cpu_model()} x{os.cpu_count()}"
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measurement_key(kind: str, space: str, example: Any, device: torch.device, processes: int) -> dict[str, Any]:
    """The key of measuring ``kind`` (e.g. ``"profile"``) of the space whose :func:`structure_digest` is ``space`` on
    ``example`` (what the first block receives) on ``device``, by ``processes`` processes at once."""
    return {"format": FORMAT, "kind": kind, "space": space, "device": device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "processes": processes, "input": [[list(t.shape), str(t.dtype)] for t in tensors_in(example)]}


def _path(folder: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{key['kind']}-{digest}.json"


def load(key: dict[str, Any], parse: Callable[[Any], T | None]) -> T | None:
    """The value stored under ``key``, through ``parse``; ``None`` when there is none, the cache is off, ``parse``
    returns ``None`` (an entry this run cannot use, e.g. one measuring less), or the file cannot be read or ``parse``
    raises ``ValueError``, ``KeyError`` or ``TypeError`` (warned: a corrupt or stale file)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = _path(folder, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as error:
        warnings.warn(f"NASPipe: cannot read the start-up cache file {path} ({error}); measuring again.", stacklevel=2)
        return None
    try:
        entry = json.loads(text)
        if entry["key"] != key:
            raise ValueError("it holds another key")
        return parse(entry["value"])
    except (ValueError, KeyError, TypeError) as error:
        warnings.warn(f"NASPipe: ignoring the unreadable start-up cache file {path} ({type(error).__name__}: {error}); "
                      "measuring again and replacing it.", stacklevel=2)
        return None


def store(key: dict[str, Any], value: Any) -> None:
    """Store ``value`` (plain JSON data) under ``key``, atomically; a cache that cannot be written only warns."""
    folder = cache_dir()
    if folder is None:
        return
    text = json.dumps({"key": key, "value": value}, indent=1).encode()

    def write(file: BinaryIO) -> None:
        file.write(text)

    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(_path(folder, key), write)
    except OSError as error:
        warnings.warn(f"NASPipe: cannot write the start-up cache in {folder} ({error}); the next run measures again. "
                      f"Set {ENV} to a writable folder, or to 0 to turn the cache off.", stacklevel=2)
