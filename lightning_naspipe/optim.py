"""Per-subnet optimizer updates and LR scheduler stepping.

Subnet ``i``'s update must touch exactly ``i``'s parameters: other subnets in flight on the
same stage may already hold gradients, and stepping them now would use the wrong learning rate
(and, for Adam, the wrong step count). So each update temporarily narrows the optimizer's
param groups to ``i``'s parameters. The sequential path runs the very same function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_naspipe.errors import NASPipeConfigError


@contextlib.contextmanager
def restrict_param_groups(optimizer: Optimizer, params: Iterable[Tensor]) -> Iterator[None]:
    """Within the body, ``optimizer``'s param groups hold only ``params`` (in group order)."""
    keep = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        yield
    finally:
        for group, group_params in zip(optimizer.param_groups, saved):
            group["params"] = group_params


def module_parameters(modules: Iterable[nn.Module]) -> list[Tensor]:
    """Trainable parameters of ``modules``, each once."""
    seen: dict[int, Tensor] = {}
    for module in modules:
        for p in module.parameters():
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
