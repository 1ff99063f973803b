"""Crash-safe checkpoint files: written next to the target, fsynced, renamed into place.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lives
in the system temp folder: when that is another filesystem the final move is a copy, and a kill
during it leaves a truncated checkpoint (and a full-size temporary file). NASPipe's default
checkpoint IO writes a hidden temporary file in the target's own folder, fsyncs it, renames it
over the target (atomic on POSIX and Windows) and fsyncs the folder, so a checkpoint path always
holds either the old file or the new one. Temporary files a killed write left behind are removed
by the next write of the same checkpoint. Remote paths (``s3://...``) keep Lightning's way.
"""

from __future__ import annotations

import os
import tempfile
import types
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lightning_naspipe.namespaces import Namespace, installed

__all__ = ["atomic_checkpoint_io", "atomic_save", "atomic_write"]

_SUFFIX = ".naspipe-partial"


def atomic_save(checkpoint: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(checkpoint, path)`` so that ``path`` never holds a partly written file."""
    atomic_write(path, lambda file: torch.save(checkpoint, file))


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into ``path`` so that ``path`` never holds a partly written file: a hidden temporary
    file in the same folder, fsynced and renamed over it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*{_SUFFIX}"):  # from a write that was killed
        with suppress(FileNotFoundError):
            stale.unlink()
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


_ATOMIC: dict[str, type] = {}


def _atomic_class(namespace: Namespace) -> type:
    name = {"lightning.pytorch": "LightningAtomicCheckpointIO"}.get(namespace.name,
                                                                    "PytorchLightningAtomicCheckpointIO")
    base = namespace.fabric_module("plugins.io.torch_io").TorchCheckpointIO

    def save_checkpoint(self: Any, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local(path):  # Lightning's error, or fsspec for remote paths
            base.save_checkpoint(self, checkpoint, path, storage_options)
            return
        atomic_save(checkpoint, str(path).removeprefix("file://"))

    body = {"save_checkpoint": save_checkpoint, "__module__": __name__,
            "__doc__": f"{namespace.name}'s TorchCheckpointIO, writing with :func:`atomic_save`."}
    atomic: type = types.new_class(name, (base,), exec_body=lambda ns: ns.update(body))
    globals()[name] = atomic  # importable by name, so it pickles
    return atomic


for _namespace in installed():
    _ATOMIC[_namespace.name] = _atomic_class(_namespace)


def atomic_checkpoint_io(namespace: Namespace) -> Any:
    """A new ``TorchCheckpointIO`` of ``namespace`` that saves with :func:`atomic_save`."""
    return _ATOMIC[namespace.name]()
