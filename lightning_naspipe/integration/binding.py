"""Which Lightning namespace a ``NASPipeStrategy`` serves, and the classes that bind it to one.

``NASPipeStrategy`` is built on neither namespace. :func:`bind_classes` makes one bound class per
installed namespace (``LightningNASPipeStrategy``, ``PytorchLightningNASPipeStrategy``): the strategy
body on that namespace's ``ParallelStrategy``, registered there as ``"naspipe"``. An instance of the
unbound class becomes one of them when a Trainer (or a plugin passed to it) reveals the namespace:
the Trainer sets the accelerator first. Trainers of either namespace accept an unbound instance,
which is registered as a virtual subclass of both ``ParallelStrategy`` classes.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from typing_extensions import override

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.checkpoint_io import atomic_checkpoint_io
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import Namespace, installed, namespace_of
from lightning_naspipe.integration.processes import StageProcesses

_BOUND: dict[str, type[NamespaceBinding]] = {}
_NAMES = {"lightning.pytorch": "LightningNASPipeStrategy", "pytorch_lightning": "PytorchLightningNASPipeStrategy"}


class NamespaceBinding(StageProcesses):
    """The namespace half of ``NASPipeStrategy``: binding, and the plugins Lightning sets. An instance serves
    no namespace (``_namespace`` ``None``) until a Trainer, or a plugin passed in, tells which."""

    def _init_plugins(self, **plugins: Any) -> None:
        """The namespace's ``ParallelStrategy.__init__`` when bound; else keep what the Trainer's connector
        reads before it sets the accelerator, and bind to a plugin's namespace if one is given."""
        self._plugins = plugins
        if self._namespace is not None:
            self._namespace.parallel_strategy.__init__(self, **plugins)
            return
        lightning.set_plugins(self, plugins["accelerator"], plugins["precision_plugin"], plugins["checkpoint_io"])
        self.cluster_environment, self.parallel_devices = plugins["cluster_environment"], plugins["parallel_devices"]
        for plugin in plugins.values():
            self._bind(namespace_of(plugin))

    @property
    @override
    def checkpoint_io(self) -> Any:
        assert self._namespace is not None, "bound by the Trainer"
        wrapping, io = lightning.wrapping_checkpoint_io(self._namespace), lightning.strategy_checkpoint_io(self)
        if io is None:  # the default: Lightning's format, written crash-safe
            io = atomic_checkpoint_io(self._namespace)
            lightning.set_strategy_checkpoint_io(self, io)
        elif isinstance(io, wrapping) and io.checkpoint_io is None:
            io.checkpoint_io = atomic_checkpoint_io(self._namespace)  # e.g. AsyncCheckpointIO()
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        lightning.set_strategy_checkpoint_io(self, io)

    @property
    def accelerator(self) -> Any:
        return lightning.strategy_accelerator(self)

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        # The Trainer sets the accelerator first: that is when an unbound strategy learns its namespace.
        self._bind(namespace_of(accelerator))
        lightning.set_strategy_accelerator(self, accelerator)

    def _bind(self, namespace: Namespace | None) -> None:
        """Become the ``namespace``'s bound class, or check that this instance already is."""
        if namespace is None or namespace is self._namespace:
            return
        if self._namespace is not None:
            raise NASPipeConfigError(
                f"This NASPipeStrategy belongs to {self._namespace.name} (a Trainer or plugin of it bound it), so it "
                f"cannot serve {namespace.name}. Create a new NASPipeStrategy(...) for each Trainer, and do not mix "
                "lightning.pytorch and pytorch_lightning objects in one Trainer."
            )
        lightning.swap_class(self, _BOUND[namespace.name])
        namespace.parallel_strategy.__init__(self, **self._plugins)

    def _info(self, message: str) -> None:
        """Lightning's ``rank_zero_info``, through this namespace's logger."""
        assert self._namespace is not None
        self._namespace.pytorch.utilities.rank_zero_info(message)


def bind_classes(body: type[NamespaceBinding]) -> None:
    """Make, register and publish (in ``body``'s module, so they pickle) one bound class per namespace."""
    module = sys.modules[body.__module__]
    for namespace in installed():
        name = _NAMES[namespace.name]
        attributes = {"_namespace": namespace, "__module__": body.__module__,
                      "__doc__": f"{body.__name__} bound to {namespace.name}."}
        def fill(namespace_dict: dict[str, Any], attributes: dict[str, Any] = attributes) -> None:
            namespace_dict.update(attributes)

        bound: Any = types.new_class(name, (body, namespace.parallel_strategy), exec_body=fill)
        setattr(module, name, bound)
        _BOUND[namespace.name] = bound
        namespace.parallel_strategy.register(body)
        bound.register_strategies(namespace.pytorch.strategies.StrategyRegistry)
