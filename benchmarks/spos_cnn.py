"""SPOS-style CNN space with a trainable stem and head: where micro-batching matters.

Single-path one-shot (SPOS) search space on small RGB images (3x16x16 by default, 10 classes;
random images and labels drawn from a fixed seed, so nothing is downloaded; ``--size 32`` gives
CIFAR's shape, but depthwise convs on one CPU thread then make a run take minutes)::

    stem (conv3x3 3->C, BN, ReLU)                             fixed: every subnet trains it
      -> blocks at full, 1/2 and 1/4 resolution (C, 2C, 4C)   choice blocks, 4 candidates each;
                                                              the first of each later resolution
                                                              has stride 2
      -> head (conv1x1 4C->8C, BN, ReLU, pool, linear 8C->10)  fixed: every subnet trains it

The candidates are SPOS's four: inverted bottlenecks with a 3x3, 5x5 or 7x7 depthwise conv, and
an Xception-like stack of three depthwise-separable 3x3 convs. Because the stem (stage 0) and
the head (last stage) are shared by all subnets, CSP cannot overlap two subnets at all (every
pair conflicts on both stages); the only pipeline parallelism left is splitting each subnet's
batch into micro-batches (``chunks``), as GPipe does. Run from the repository root::

    python benchmarks/spos_cnn.py            # one device vs 2 stages at chunks 1/2/4/8
    python benchmarks/spos_cnn.py --quick    # smaller, < 2 min
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp
from common import Result, add_common_args, bar_chart, fit_timed, launch, machine, naspipe_strategy, plot
from common import print_table, ran_as_worker, time_balance, write_json
from lightning_naspipe.pipeline.placement.partition import stage_ranges
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from schedule_model import modelled_speedup, ranges_of

CLASSES = 10
#: (label, stages, schedule, chunks)
CONFIGS = [("1 device", 0, "csp", 1), ("csp chunks 1", 2, "csp", 1), ("csp chunks 2", 2, "csp", 2),
           ("csp chunks 4", 2, "csp", 4), ("csp chunks 8", 2, "csp", 8), ("gpipe chunks 4", 2, "gpipe", 4),
           ("one_in_flight", 2, "one_in_flight", 1)]


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)


class Candidate(nn.Module):
    """``body(x)``, plus ``x`` when the shape is kept (residual, as in SPOS/ShuffleNet blocks)."""

    def __init__(self, body: nn.Module, residual: bool) -> None:
        super().__init__()
        self.body, self.residual = body, residual

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.body(x)
        return x + y if self.residual else y


def inverted_bottleneck(cin: int, cout: int, kernel: int, stride: int, expand: int = 3) -> Candidate:
    mid = cin * expand
    body = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, kernel, stride, groups=mid),
                         conv_bn(mid, cout, 1, relu=False))
    return Candidate(body, stride == 1 and cin == cout)


def xception(cin: int, cout: int, stride: int) -> Candidate:
    body = nn.Sequential(conv_bn(cin, cin, 3, stride, groups=cin, relu=False), conv_bn(cin, cout, 1),
                         conv_bn(cout, cout, 3, groups=cout, relu=False), conv_bn(cout, cout, 1),
                         conv_bn(cout, cout, 3, groups=cout, relu=False), conv_bn(cout, cout, 1))
    return Candidate(body, stride == 1 and cin == cout)


def choice(cin: int, cout: int, stride: int) -> lnp.ChoiceBlock:
    return lnp.ChoiceBlock({"ib3": inverted_bottleneck(cin, cout, 3, stride),
                            "ib5": inverted_bottleneck(cin, cout, 5, stride),
                            "ib7": inverted_bottleneck(cin, cout, 7, stride), "xception": xception(cin, cout, stride)})


class SposCNN(lnp.NASPipeMixin, pl.LightningModule):
    """Stem, ``per_resolution`` choice blocks at each of 3 resolutions, head."""

    def __init__(self, channels: int = 16, per_resolution: int = 3) -> None:
        super().__init__()
        blocks: list[nn.Module] = [conv_bn(3, channels, 3)]
        cin = channels
        for level in range(3):
            cout = channels * 2**level
            for i in range(per_resolution):
                blocks.append(choice(cin, cout, 2 if level > 0 and i == 0 else 1))
                cin = cout
        blocks.append(nn.Sequential(conv_bn(cin, 2 * cin, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                    nn.Linear(2 * cin, CLASSES)))
        self.supernet = lnp.Supernet(*blocks)

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=4e-5)


def random_images(count: int, batch: int, size: int = 16) -> DataLoader[tuple[Tensor, ...]]:
    """``count`` random ``3 x size x size`` images and labels, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(count, 3, size, size, generator=gen)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (count,), generator=gen)), batch_size=batch)


def worker(cfg: dict[str, Any]) -> None:
    module = SposCNN(cfg["channels"], cfg["per_resolution"])
    data = random_images(cfg["subnets"] * cfg["batch"], cfg["batch"], cfg["size"])
    fit_timed(module, data, cfg, naspipe_strategy(cfg), max(cfg["stages"], 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--per-resolution", type=int, default=3, help="choice blocks per resolution (3 of them)")
    parser.add_argument("--size", type=int, default=16, help="image side")
    parser.add_argument("--batch", type=int, default=128, help="images per subnet (split into chunks)")
    parser.add_argument("--subnets", type=int, default=80, help="subnets per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="fewer subnets, no chunks 8 / one_in_flight rows")
    parser.add_argument("--plot", default="docs/spos_cnn.png")
    parser.add_argument("--default-split", action="store_true",
                        help="no balance: the strategy's own split (timed on the first batch); default window 8")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    configs = CONFIGS
    if args.quick:
        args.subnets, args.warmup, args.window, args.per_resolution, args.batch = 48, 16, 16, 2, 64
        configs = [c for c in CONFIGS if c[0] not in ("csp chunks 8", "one_in_flight")]
    module = SposCNN(args.channels, args.per_resolution)
    balance = time_balance(module.supernet, random_images(args.batch, args.batch, args.size).dataset[:][0], 2)
    if args.default_split:
        balance, args.window = None, 8
    print(f"space: SPOS-style CNN, {len(module.supernet)} blocks (trainable stem and head, 4 candidates per choice "
          f"block), {args.channels} base channels, {args.size}x{args.size} inputs, batch {args.batch} per subnet; "
          f"window {args.window}, balance {balance}; {machine()}")
    print("1 device: plain pl.Trainer(); other rows: NASPipeStrategy(schedule=..., chunks=...) on 2 stage processes")
    print("exact: yes = bitwise the plain Trainer; yes* = bitwise runs with the same chunks (BatchNorm and float "
          "sums see micro-batches)")
    print("model: speed-up over 1 device predicted by the schedule alone (schedule_model.py)\n")
    base = {k: getattr(args, k) for k in ("channels", "per_resolution", "size", "batch", "subnets", "warmup", "window")}
    results: dict[str, Result] = {}
    for name, stages, schedule, chunks in configs:
        cfg = {**base, "stages": stages, "processes": max(stages, 1), "schedule": schedule, "chunks": chunks,
               "balance": balance}
        results[name] = launch(__file__, cfg, args.repeats)
        if stages:  # what the schedule alone predicts (schedule_model.py)
            split = balance or [len(r) for r in stage_ranges(module.supernet, 2)]  # the model needs one
            results[name]["model"] = modelled_speedup(module.supernet, ranges_of(split),
                                                      lambda i: uniform_architecture(module.supernet.labels, 0, i),
                                                      schedule, chunks, args.window)
    rows = [(name, "yes" if chunks == 1 else "yes*", results[name]) for name, _, _, chunks in configs]
    print_table([], rows, ["1 device", "csp chunks 1"])
    write_json(args.json, results)

    def render(ax: Any) -> None:
        bar_chart(ax, [c[0] for c in configs], [results[c[0]] for c in configs], results["1 device"], "subnets/s")

    plot(args.plot, render, f"SPOS-style CNN (shared stem+head), 2 stages, ratio vs 1 device ({machine(short=True)})")


if __name__ == "__main__":
    main()
