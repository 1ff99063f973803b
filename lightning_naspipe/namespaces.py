"""Lightning's two namespaces, ``lightning.pytorch`` and ``pytorch_lightning``, side by side.

They are two copies of the same code: a ``lightning.pytorch.Trainer`` only accepts strategies,
callbacks and plugins built on ``lightning.pytorch`` and ``lightning.fabric`` classes, a
``pytorch_lightning.Trainer`` only those built on ``pytorch_lightning`` and ``lightning_fabric``.
Everything in this library that touches a namespace-specific class goes through a
:class:`Namespace`, so one install serves both and never mixes the two.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

__all__ = ["Namespace", "installed", "namespace_of", "overrides_hook"]


@dataclass(frozen=True)
class Namespace:
    """One Lightning namespace: its trainer package (``pytorch``) and its fabric package."""

    name: str
    pytorch: ModuleType
    fabric: ModuleType

    def pytorch_module(self, path: str) -> ModuleType:
        """``pytorch.<path>``, e.g. ``pytorch_module("strategies.launchers")``."""
        return importlib.import_module(f"{self.pytorch.__name__}.{path}")

    def fabric_module(self, path: str) -> ModuleType:
        """``fabric.<path>``, e.g. ``fabric_module("utilities.distributed")``."""
        return importlib.import_module(f"{self.fabric.__name__}.{path}")

    @property
    def parallel_strategy(self) -> Any:
        return self.pytorch.strategies.ParallelStrategy

    @property
    def version(self) -> str:
        return str(self.pytorch.__version__)


# (trainer package, fabric package, top-level names that identify the namespace)
_KNOWN = {
    "lightning.pytorch": ("lightning.pytorch", "lightning.fabric", ("lightning.pytorch", "lightning.fabric")),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric", ("pytorch_lightning", "lightning_fabric")),
}


@cache
def installed() -> tuple[Namespace, ...]:
    """The namespaces importable here, ``lightning.pytorch`` first."""
    found = []
    for name, (pytorch, fabric, _) in _KNOWN.items():
        try:
            found.append(Namespace(name, importlib.import_module(pytorch), importlib.import_module(fabric)))
        except ImportError:
            continue
    if not found:
        raise ImportError("lightning_naspipe needs Lightning: pip install lightning (or pytorch-lightning)")
    return tuple(found)


def namespace_of(obj: object) -> Namespace | None:
    """The namespace whose classes ``obj`` (an instance or a class) is built on, or None."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        module = klass.__module__
        for ns in installed():
            if any(module == top or module.startswith(top + ".") for top in _KNOWN[ns.name][2]):
                return ns
    return None


def overrides_hook(owner: object, hook: str, defaults: tuple[str, ...]) -> bool:
    """Whether ``owner`` has its own ``hook``: set on the instance (``LambdaCallback``), or defined by a class in
    its MRO other than those named in ``defaults`` (Lightning's no-op definitions, e.g. ``"ModelHooks"``)."""
    if hook in getattr(owner, "__dict__", {}):
        return True
    defined = next((c for c in type(owner).__mro__ if hook in vars(c)), None)
    return defined is not None and defined.__name__ not in defaults
