"""``compute_loss`` must leave the module's state outside the supernet alone when several processes train.

On several processes ``compute_loss`` runs on the last stage only, and with replicas on each replica's share of
the micro-batches. A counter or buffer it updates (``self.samples_seen += len(batch)``) changes in that process
alone: the checkpoint and the logs (from rank 0) never see it, and the run differs from the plain Trainer
silently. :class:`OutsideState` notices such a change on the first call that makes it and refuses it, naming the
attribute and where to keep it instead. It watches the module's public attributes that hold a number, string
or tensor, and its buffers outside the supernet; a container changed in place (``self.history.append(...)``)
is not seen.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_naspipe.compat.torch import tensor_version
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.supernet import supernet_of

_WATCHED = (bool, int, float, str, Tensor)


class OutsideState:
    """A snapshot of ``module``'s attributes and its buffers outside ``supernet``, to compare after a call."""

    def __init__(self, module: Any, supernet: nn.Module) -> None:
        inside = {id(buffer) for buffer in supernet.buffers()}
        self.module = module
        self.buffers = [(name, buffer) for name, buffer in module.named_buffers() if id(buffer) not in inside] \
            if isinstance(module, nn.Module) else []

    def snapshot(self) -> tuple[dict[str, Any], list[int]]:
        """The watched attributes (by value, tensors by identity) and the buffers' version counters."""
        attributes = {name: value for name, value in vars(self.module).items()
                      if not name.startswith("_") and isinstance(value, _WATCHED)}
        return attributes, [tensor_version(buffer) for _, buffer in self.buffers]

    def changed(self, before: tuple[dict[str, Any], list[int]]) -> list[str]:
        """What changed since ``before`` (attribute and buffer names)."""
        attributes, versions = before
        now, _ = self.snapshot()
        names = [name for name in attributes.keys() | now.keys()
                 if name not in attributes or name not in now or not _same(attributes[name], now[name])]
        names += [name for (name, buffer), version in zip(self.buffers, versions)
                  if tensor_version(buffer) != version or self.module.get_buffer(name) is not buffer]
        return sorted(names)

    def refuse_changes(self, before: tuple[dict[str, Any], list[int]]) -> None:
        """Raise :class:`NASPipeConfigError` when ``compute_loss`` changed something since ``before``."""
        changed = self.changed(before)
        if changed:
            raise NASPipeConfigError(
                f"compute_loss changed {', '.join(changed)} of {type(self.module).__name__}, outside the supernet. "
                "On several processes compute_loss runs on the last stage only (on a replica's share of the "
                "micro-batches), so the checkpoint, the logs and the other processes never see the change and the "
                "run would differ from the plain Trainer. Update it in on_train_subnet_end(index, architecture, "
                "loss), which every process runs for every subnet, or self.log the value from compute_loss."
            )


def outside_state(module: Any) -> OutsideState:
    """``module``'s :class:`OutsideState`, made once (the buffers outside the supernet do not change)."""
    cache = vars(module)
    if "_naspipe_outside_state" not in cache:
        cache["_naspipe_outside_state"] = OutsideState(module, supernet_of(module))
    return cache["_naspipe_outside_state"]  # type: ignore[no-any-return]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return type(a) is type(b) and bool(a == b)
