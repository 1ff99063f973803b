"""Saving a frozen subnet as a folder that loads without this library (or the user's code).

The folder holds ``architecture.json`` (the architecture and how the program was exported),
``weights.pt`` (the module's ``state_dict``, e.g. to rebuild it with the user's own code) and
``program.pt2``, a ``torch.export`` program of the module in eval mode: ``torch.export.load(path)
.module()`` runs it in a process that imports only torch, bitwise like the module it came from.
With ``latency_repeats``, ``architecture.json`` also records the module's latency measured end to end on the
example input, with the device and batch size it was measured at: a latency means nothing without them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_naspipe.compat.torch import pytree
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.latency import batch_size_of, device_name
from lightning_naspipe.searching.timing import time_module

ARCHITECTURE_FILE = "architecture.json"
WEIGHTS_FILE = "weights.pt"
PROGRAM_FILE = "program.pt2"

__all__ = ["load_subnet", "save_subnet"]


def save_subnet(module: nn.Module, folder: str | os.PathLike[str], example_input: Any,
                architecture: Mapping[str, int] | None = None, latency_repeats: int | None = None) -> Path:
    """Write ``module`` (e.g. ``supernet.freeze(architecture)``) to ``folder``, replacing what is there.

    Args:
        module: the standalone subnet.
        folder: where to write; written beside it first and renamed into place, so a killed save
            leaves the previous folder (or none), never a partial one.
        example_input: one input as the module takes it; the exported program accepts other batch
            sizes where the module allows (the first dimension of every tensor is exported as dynamic).
        architecture: stored in ``architecture.json`` (default: ``module.architecture`` if set).
        latency_repeats: time ``module(example_input)`` this many times (eval mode, no gradients, after warm-up,
            the median) and store ``{"latency": {"ms", "device", "batch_size", "repeats"}}`` in
            ``architecture.json``; ``None``: no latency recorded.

    Returns:
        The folder.
    """
    target = Path(folder)
    architecture = dict(architecture if architecture is not None else getattr(module, "architecture", {}))
    was_training = module.training
    module.eval()
    try:
        program, dynamic = _export(module, example_input)
        latency = None if latency_repeats is None else {
            "ms": time_module(module, example_input, latency_repeats), "device": device_name(module),
            "batch_size": batch_size_of(example_input), "repeats": latency_repeats}
    finally:
        module.train(was_training)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        described: dict[str, Any] = {"architecture": architecture, "dynamic_batch": dynamic, "torch": torch.__version__}
        if latency is not None:
            described["latency"] = latency
        (staging / ARCHITECTURE_FILE).write_text(json.dumps(described, indent=2))
        torch.save(module.state_dict(), staging / WEIGHTS_FILE)
        torch.export.save(program, staging / PROGRAM_FILE)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_subnet(folder: str | os.PathLike[str]) -> nn.Module:
    """The program :func:`save_subnet` wrote, as a module (what ``torch.export.load(...).module()`` gives)."""
    path = Path(folder) / PROGRAM_FILE
    if not path.is_file():
        raise NASPipeConfigError(f"{folder} holds no {PROGRAM_FILE}; write it with lightning_naspipe.save_subnet.")
    return torch.export.load(path).module()


def load_architecture(folder: str | os.PathLike[str]) -> dict[str, int]:
    """The architecture stored by :func:`save_subnet`."""
    return dict(json.loads((Path(folder) / ARCHITECTURE_FILE).read_text())["architecture"])


def _export(module: nn.Module, example_input: Any) -> tuple[Any, bool]:
    args = (example_input,)
    with torch.no_grad():
        try:
            # AUTO: dynamic where the module allows it, specialised (not an error) where it does not.
            dims = pytree.tree_map(lambda v: {0: torch.export.Dim.AUTO} if isinstance(v, Tensor) and v.dim() else None,
                            args)
            return torch.export.export(module, args, dynamic_shapes=dims), True
        except Exception:  # noqa: BLE001 - a module export cannot make dynamic: export it for this shape
            pass
        try:
            return torch.export.export(module, args), False
        except Exception as error:
            raise NASPipeConfigError(
                f"torch.export cannot export this subnet ({type(error).__name__}: {str(error)[:500]}). Save "
                f"module.state_dict() instead and rebuild it with supernet.freeze(architecture)."
            ) from error
