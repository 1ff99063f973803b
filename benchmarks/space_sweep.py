"""Space sweep (NASPipe paper, Figure-5 trend): throughput vs candidates per choice block.

A character-level language model supernet trained on the Python standard library's own source
(bytes 0..255, no download). Every layer is a choice block of pre-LayerNorm causal transformer
layers; candidate ``k`` varies heads (1/2/4/8), MLP ratio (1..4) and activation (GELU/ReLU/SiLU),
ordered so that every prefix of 4 candidates holds each ratio once: the expected compute per
subnet is the same for 4, 8, ..., 48 candidates and only the parameter sharing changes.

The byte embedding and the output head are one more decision, label ``"io"``: candidate ``k``
owns an embedding (with learned positions) and an output head. So no trainable block is shared
by all subnets, and two subnets conflict on a stage only when they pick the same candidate
there. ``--shared-io`` makes them fixed blocks instead (every subnet conflicts on both stages).

Run from the repository root::

    python benchmarks/space_sweep.py               # 4..48 candidates, all schedules, ~15 min on 2 cores
    python benchmarks/space_sweep.py --quick       # 4 and 32 candidates, smaller model, < 2 min
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp
from common import Result, add_common_args, fit_timed, launch, machine, naspipe_strategy, plot, print_table, rate
from common import ran_as_worker, ratio, time_balance, write_json
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from schedule_model import modelled_speedup, ranges_of

VOCAB = 256
HEADS, RATIOS, ACTIVATIONS = (1, 2, 4, 8), (1, 2, 3, 4), (nn.GELU, nn.ReLU, nn.SiLU)
MAX_CANDIDATES = len(HEADS) * len(RATIOS) * len(ACTIVATIONS)
#: Pipeline rows per stage count: (label, schedule, chunks).
SCHEDULES = [("csp", "csp", 1), ("one_in_flight", "one_in_flight", 1), ("gpipe chunks 4", "gpipe", 4),
             ("async", "async", 1)]
EXACT = {"csp": "yes", "one_in_flight": "yes", "gpipe": "yes*", "async": "NO"}
BASE = "1 device"


def layer_config(k: int) -> tuple[int, int, type[nn.Module]]:
    """Candidate ``k``'s (heads, MLP ratio, activation); distinct for ``k < 48``."""
    return HEADS[k % 4], RATIOS[(k // 4 + k) % 4], ACTIVATIONS[(k // 16) % 3]


class CausalLayer(nn.Module):
    """Pre-LN transformer layer: ``x + attention(LN(x))`` then ``x + MLP(LN(x))``, causal."""

    def __init__(self, width: int, heads: int, ratio: int, activation: type[nn.Module]) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, ratio * width), activation(), nn.Linear(ratio * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        y: Tensor = self.mlp(self.norm2(x))
        return x + y


class Embed(nn.Module):
    """Byte embedding plus learned positions."""

    def __init__(self, width: int, seq: int) -> None:
        super().__init__()
        self.table, self.positions = nn.Embedding(VOCAB, width), nn.Parameter(torch.zeros(seq, width))

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.table(x)
        return y + self.positions


def head(width: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, VOCAB))


class CharLM(lnp.NASPipeMixin, pl.LightningModule):
    """The supernet: io embedding, ``layers`` choice blocks of ``candidates`` layers, io head."""

    def __init__(self, candidates: int, layers: int = 8, width: int = 128, seq: int = 64,
                 shared_io: bool = False) -> None:
        super().__init__()
        if not 1 <= candidates <= MAX_CANDIDATES:
            raise ValueError(f"candidates must be in 1..{MAX_CANDIDATES}, got {candidates}")
        io_in = Embed(width, seq) if shared_io else lnp.ChoiceBlock([Embed(width, seq) for _ in range(candidates)],
                                                                    label="io")
        io_out = head(width) if shared_io else lnp.ChoiceBlock([head(width) for _ in range(candidates)], label="io")
        choices = [lnp.ChoiceBlock([CausalLayer(width, *layer_config(k)) for k in range(candidates)])
                   for _ in range(layers)]
        self.supernet = lnp.Supernet(io_in, *choices, io_out)

    def compute_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.reshape(-1, VOCAB), batch[1].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def stdlib_bytes(count: int) -> Tensor:
    """``count`` bytes of the standard library's top-level ``.py`` files, in sorted file order."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= count:
            break
    data = data * (count // max(len(data), 1) + 1)  # only if the stdlib is tiny
    return torch.frombuffer(data[:count], dtype=torch.uint8).long()


def text_loader(sequences: int, seq: int, batch: int) -> DataLoader[tuple[Tensor, ...]]:
    """Next-byte prediction: ``x`` a window of ``seq`` bytes, ``y`` the same shifted by one."""
    text = stdlib_bytes(sequences * (seq + 1)).view(sequences, seq + 1)
    return DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=batch)


def worker(cfg: dict[str, Any]) -> None:
    module = CharLM(cfg["candidates"], cfg["layers"], cfg["width"], cfg["seq"], cfg["shared_io"])
    data = text_loader(cfg["subnets"] * cfg["batch"], cfg["seq"], cfg["batch"])
    fit_timed(module, data, cfg, naspipe_strategy(cfg), max(cfg["stages"], 1))


def configs(stage_counts: list[int]) -> list[tuple[str, int, str, int]]:
    """``(row label, stages, schedule, chunks)``; labels name the stage count only when several are run."""
    rows = [(BASE, 0, "csp", 1)]
    for stages in stage_counts:
        suffix = f" x{stages}" if len(stage_counts) > 1 else ""
        rows += [(label + suffix, stages, schedule, chunks) for label, schedule, chunks in SCHEDULES]
    return rows


def sweep(args: argparse.Namespace, script: str = __file__) -> dict[int, dict[str, Result]]:
    """Measure every configuration for every candidate count; print a table per count and stage count."""
    # Time-balanced splits, the same for every candidate count (candidate prefixes are alike).
    probe = CharLM(4, args.layers, args.width, args.seq, args.shared_io)
    x = text_loader(args.batch, args.seq, args.batch).dataset[:][0]
    balance = {s: time_balance(probe.supernet, x, s) for s in args.stages}
    print(f"stage split (blocks per stage, by measured time): {balance}\n")
    base = {k: getattr(args, k) for k in ("layers", "width", "seq", "batch", "subnets", "warmup", "window")}
    results: dict[int, dict[str, Result]] = {}
    for candidates in args.candidates:
        found: dict[str, Result] = {}
        results[candidates] = found
        for name, stages, schedule, chunks in configs(args.stages):
            cfg = {**base, "candidates": candidates, "stages": stages, "processes": max(stages, 1),
                   "schedule": schedule, "chunks": chunks, "balance": balance.get(stages), "shared_io": args.shared_io}
            found[name] = launch(script, cfg, args.repeats)
            if stages:  # what the schedule alone predicts, for reading noisy numbers (schedule_model.py)
                shape = CharLM(candidates, args.layers, 8, args.seq, args.shared_io).supernet  # width is irrelevant
                found[name]["model"] = modelled_speedup(shape, ranges_of(balance[stages]),
                                                        lambda i: uniform_architecture(shape.labels, 0, i),
                                                        schedule, chunks, args.window)
        for stages in args.stages:
            rows = [(BASE, "yes", found[BASE])]
            rows += [(n, EXACT[sch], found[n]) for n, s, sch, _ in configs(args.stages) if s == stages]
            print_table([f"{candidates} candidates per choice block, {stages} stages:"], rows, [BASE, rows[2][0]])
    return results


def draw(results: dict[int, dict[str, Result]], stage_counts: list[int]) -> Any:
    def render(axes: Any) -> None:
        counts = sorted(results)
        rows = configs(stage_counts)
        for name, *_ in rows:
            axes[0].plot(counts, [rate(results[c][name]) for c in counts], marker="o", label=name)
        for stages in stage_counts:
            csp, oif = [n for n, s, sch, _ in rows if s == stages and sch in ("csp", "one_in_flight")]
            tag = f" x{stages}" if len(stage_counts) > 1 else ""
            for label, ref in ((f"csp{tag} vs 1 device", BASE), (f"csp{tag} vs one_in_flight", oif)):
                axes[1].plot(counts, [ratio(results[c][csp], results[c][ref]) for c in counts], marker="o",
                             label=label)
        for ax, label in zip(axes, ("subnets/s", "speed-up (same run)")):
            ax.set_xlabel("candidates per choice block")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(c) for c in counts])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[1].axhline(1.0, color="grey", lw=0.8)
    return render


def model_args(parser: argparse.ArgumentParser) -> None:
    """The char-LM space's and the run's flags (also used by ``ddp_baseline.py`` and ``overhead.py``)."""
    parser.add_argument("--layers", type=int, default=8, help="choice blocks of transformer layers")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences per subnet (per rank and step for DDP)")
    parser.add_argument("--subnets", type=int, default=160, help="subnets trained per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--window", type=int, default=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    model_args(parser)
    parser.add_argument("--stages", type=int, nargs="+", default=[2], help="pipeline stage counts, e.g. 2 4")
    parser.add_argument("--shared-io", action="store_true", help="embedding and head as fixed (shared) blocks")
    parser.add_argument("--quick", action="store_true", help="4 and 32 candidates, a smaller model, fewer subnets")
    parser.add_argument("--plot", default="docs/space_sweep.png")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    if args.quick:
        args.candidates, args.layers, args.width, args.subnets, args.warmup, args.window = [4, 32], 4, 64, 48, 16, 16
    print(f"space: char LM on stdlib source, {args.layers} choice layers, width {args.width}, seq {args.seq}, "
          f"batch {args.batch}, io {'shared' if args.shared_io else 'a choice'}; window {args.window}; {machine()}")
    print(f"1 device: plain pl.Trainer(); other rows: NASPipeStrategy(schedule=..., window={args.window}), one "
          "process per stage")
    print("exact: yes = bitwise the plain Trainer; yes* = bitwise runs with the same chunks; NO = not reproducible")
    print("model: speed-up over 1 device predicted by the schedule alone (schedule_model.py: backward = 2 x forward, "
          "no communication or overhead)\n")
    results = sweep(args)
    write_json(args.json, {str(c): r for c, r in results.items()})
    stages = "/".join(map(str, args.stages))
    plot(args.plot, draw(results, args.stages), f"char-LM supernet, {stages} stages vs 1 device: {args.layers} layers, "
         f"width {args.width}, window {args.window} ({machine(short=True)})", panels=2)


if __name__ == "__main__":
    main()
