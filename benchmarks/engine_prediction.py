"""The planner against the engine on one stage, in process: predicted vs measured subnets/s of a real supernet.

Both sides use this thread's CPU time (one intra-op thread), so other jobs do not stretch either; but on a busy
2-core machine a neighbour on the other core still slows single runs by up to ~40% (shared caches and core), in
bursts. So short profiles and measurements alternate, seven each, and their medians are compared, three times.
Typically under 10% apart on a quiet machine (it was a test's 25% assertion until issue 44 moved timings out of
the tests). Run from the repository root::

    python benchmarks/engine_prediction.py
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.planning import profile_supernet
from lightning_naspipe.planning.planner import simulate

SEED = 3


class EngineModule:
    """The parts of a NASPipe LightningModule the engine uses, without Lightning: SGD and a regression loss."""

    naspipe_seed = SEED

    def __init__(self, supernet: lnp.Supernet) -> None:
        self.supernet = supernet
        self.optimizer = torch.optim.SGD(supernet.parameters(), lr=0.01, momentum=0.9)
        self.trainer = SimpleNamespace(lr_scheduler_configs=[], callback_metrics={})

    def sample_subnet(self, index: int) -> dict[str, int]:
        return uniform_architecture(self.supernet.labels, self.naspipe_seed, index)

    def sample_step(self, step: int) -> list[dict[str, int]]:
        return [self.sample_subnet(step)]

    def pipeline_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizers(self) -> Any:
        return SimpleNamespace(optimizer=self.optimizer, step=self.optimizer.step)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, batch, count, window = 192, 32, 64, 4
    net = lnp.Supernet(nn.Linear(width, width), *[
        lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(6)] + [nn.Identity()])
        for _ in range(5)])
    sample = torch.randn(batch, width)
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(count)]
    module, engine = EngineModule(net), Engine([range(len(net))])

    def train() -> float:
        start = time.thread_time()
        for first in range(0, count, window):
            engine.train_window(module, data[first:first + window], first)
        return count / (time.thread_time() - start)

    train()  # warms up kernels and creates the optimizer state
    print("round  predicted subnets/s  measured subnets/s  error of the medians")
    for round_ in range(3):
        predicted, measured = [], []
        for _ in range(7):
            spec = profile_supernet(net, sample, repeats=1, clock=time.thread_time, engine_seconds=0.1)
            predicted.append(simulate(spec, 1, window, subnets=count, seed=SEED).subnets_per_s)
            measured.append(train())
        p, m = statistics.median(predicted), statistics.median(measured)
        print(f"{round_:>5}  {p:>19.0f}  {m:>18.0f}  {100 * (p / m - 1):>+19.1f}%")


if __name__ == "__main__":
    main()
