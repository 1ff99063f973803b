"""Per-subnet optimizer updates and LR scheduler stepping.

Subnet ``i``'s update must touch exactly ``i``'s parameters: other subnets in flight on the
same stage may already hold gradients, and stepping them now would use the wrong learning rate
(and, for Adam, the wrong step count). So each update temporarily narrows the optimizer's
param groups to ``i``'s parameters. The sequential path runs the very same function.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.supernet import ResourceState


@contextlib.contextmanager
def restrict_param_groups(optimizer: Optimizer, params: Iterable[Tensor]) -> Iterator[None]:
    """Within the body, ``optimizer``'s param groups hold only ``params`` (in group order).

    Costs O(len(params)), not O(all parameters): supernets have many candidates per subnet used.
    """
    saved = [group["params"] for group in optimizer.param_groups]
    params = list(params)
    restricted = _locate(params, saved, _positions(optimizer, saved))
    if restricted is None:  # a parameter moved or is new: the groups were edited, index them again
        _POSITIONS.pop(optimizer, None)
        restricted = _locate(params, saved, _positions(optimizer, saved)) or [[] for _ in saved]
    try:
        for group, chosen in zip(optimizer.param_groups, restricted):
            group["params"] = [p for _, p in sorted(chosen, key=lambda item: item[0])]
        yield
    finally:
        for group, group_params in zip(optimizer.param_groups, saved):
            group["params"] = group_params


def _locate(params: list[Tensor], groups: list[list[Tensor]],
            position: dict[int, tuple[int, int]]) -> list[list[tuple[int, Tensor]]] | None:
    """Per group, ``(index, param)`` of ``params``; ``None`` if the index table is stale."""
    found: list[list[tuple[int, Tensor]]] = [[] for _ in groups]
    for p in params:
        where = position.get(id(p))
        if where is None or groups[where[0]][where[1]] is not p:
            if any(p is q for group in groups for q in group):
                return None
            continue  # not in this optimizer (e.g. frozen): nothing to step
        found[where[0]].append((where[1], p))
    return found


_POSITIONS: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], dict[int, tuple[int, int]]]] = (
    weakref.WeakKeyDictionary()
)


def _positions(optimizer: Optimizer, groups: list[list[Tensor]]) -> dict[int, tuple[int, int]]:
    """``id(param) -> (group, index)``, cached per optimizer while its groups keep their sizes."""
    shape = tuple(len(g) for g in groups)
    cached = _POSITIONS.get(optimizer)
    if cached is None or cached[0] != shape:
        table = {id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group)}
        cached = _POSITIONS[optimizer] = (shape, table)
    return cached[1]


def flat_positions(optimizer: Optimizer, params: Iterable[Tensor]) -> dict[int, int]:
    """``id(p) -> p's position in the optimizer's param groups, concatenated`` for each of ``params`` in
    the optimizer. Costs O(len(params)) while the groups keep their sizes; call it outside
    :func:`restrict_param_groups`."""
    groups = [group["params"] for group in optimizer.param_groups]
    offsets = [0]
    for group in groups:
        offsets.append(offsets[-1] + len(group))
    params = list(params)
    located = _locate(params, groups, _positions(optimizer, groups))
    if located is None:  # a parameter moved: index the groups again
        _POSITIONS.pop(optimizer, None)
        located = _locate(params, groups, _positions(optimizer, groups)) or []
    return {id(p): offsets[g] + i for g, chosen in enumerate(located) for i, p in chosen}


def module_parameters(modules: Iterable[nn.Module]) -> list[Tensor]:
    """Trainable parameters of ``modules``, each once."""
    seen: dict[int, Tensor] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def resource_parameters(states: Iterable[ResourceState]) -> list[Tensor]:
    """Trainable parameters of resources, each once."""
    seen: dict[int, Tensor] = {}
    for state in states:
        for p in state.params:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def step_schedulers(configs: Sequence[Any], interval: str, count: int, monitor_values: dict[str, Any]) -> None:
    """Step the schedulers of ``interval`` whose frequency divides ``count``.

    Args:
        configs: Lightning's ``LRSchedulerConfig`` list (``trainer.lr_scheduler_configs``).
        interval: ``"step"`` (after each subnet's update) or ``"epoch"``.
        count: how many steps/epochs have completed, 1-based.
        monitor_values: metrics for ``ReduceLROnPlateau`` (``trainer.callback_metrics``).
    """
    for config in configs:
        if config.interval != interval or count % config.frequency != 0:
            continue
        if isinstance(config.scheduler, ReduceLROnPlateau):
            if interval == "step":
                raise NASPipeConfigError(
                    "ReduceLROnPlateau with interval='step' is not supported by NASPipe (there is no per-subnet "
                    "metric to monitor); use interval='epoch'."
                )
            if config.monitor not in monitor_values:
                raise NASPipeConfigError(
                    f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged; log it with "
                    f"self.log({config.monitor!r}, ...) or change the scheduler's 'monitor'. "
                    f"Logged: {sorted(monitor_values)}."
                )
            config.scheduler.step(monitor_values[config.monitor])
        else:
            config.scheduler.step()
