"""The GPU check: the CUDA paths nothing else runs, in one command that prints one table.

On a machine with a GPU, from the repository root (under 5 minutes on one GPU)::

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --device cpu --quick     # the same checks on CPU: a dry run

Each row is also printed the moment it is measured (and ``--json`` rewritten), so a run stopped at a
time limit still reports what it finished. Without installing the package (e.g. on a machine whose
torch is preinstalled and older than ``pyproject.toml`` asks for), run it as
``PYTHONPATH=$PWD python3 benchmarks/gpu_check.py``.

Rows (each configuration runs in fresh processes, ``common.launch``):

- ``exact gloo``: the zoo's NB201 and char-LM spaces, 1 device (the plain Trainer) against
  2 stages as two processes on the *same* device with gloo on its tensors (one GPU cannot host two
  NCCL ranks), weights compared bitwise (``Trainer(deterministic=True)``).
- ``exact nccl``: the same with the stages on ``cuda:0`` and ``cuda:1`` over NCCL, where 2 GPUs exist.
- ``exact, norm clipping``: NB201 as ``exact gloo`` with ``Trainer(gradient_clip_val=1.0)``: each stage's
  per-tensor gradient norms (``torch._foreach_norm``'s CUDA kernel on its own tensors) and the exchanged
  total give the one-device norm, bitwise.
- ``offload``: 2 stages with ``offload=True`` (the CUDA side stream copies ahead of the schedule)
  against the same run without it, bitwise; the prefetch hit rate, the stall time's share of the
  run and the peak device bytes as a share of the stage's partition.
- ``speed``: each zoo space, subnets/s of 2 stages over 1 device with default settings (2 GPUs and
  NCCL where they exist, else two processes sharing one device).
- ``grid``: stages x data-parallel replicas. NB201 with ``chunks=4`` on 1 device against every layout of 2
  processes (2x1, 1x2) and, with 4 GPUs, of 4 (4x1, 2x2, 1x4), over NCCL where there are as many GPUs as
  processes (else gloo, the processes sharing one device): weights compared bitwise and subnets/s per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from common import Clock, add_common_args, launch, ok, ran_as_worker  # noqa: E402
from zoo_spaces import SPACES, space  # noqa: E402

EXACT_SPACES = ("nb201", "charlm")
#: Where the exact rows' workers leave their weights (``main`` sets it).
WEIGHTS_DIR = ""


def worker(cfg: dict[str, Any]) -> None:
    """Train one configuration; rank 0 writes subnets/s, the stage metrics and the weights' file."""
    chosen = space(cfg["space"], cfg["quick"])
    device = torch.device(cfg["device"])
    strategy: Any = "auto"
    devices: Any = [device.index or 0] if device.type == "cuda" else 1
    if cfg["stages"]:
        # Two stages on one device: two entries of the same device; on two GPUs: cuda:0 and cuda:1.
        parallel = [torch.device(d) for d in cfg["parallel_devices"]]
        strategy = lnp.NASPipeStrategy(chunks=cfg.get("chunks") or chosen.chunks, offload=cfg.get("offload", False),
                                       num_stages=cfg.get("num_stages"), process_group_backend=cfg["backend"],
                                       parallel_devices=parallel)
    clock = Clock(chosen.warmup, 1)
    trainer = pl.Trainer(accelerator=device.type, devices=devices, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[clock],
                         deterministic=cfg["exact"], gradient_clip_val=cfg.get("clip"))
    module = chosen.model()
    trainer.fit(module, chosen.data(cfg["subnets"] or chosen.subnets))
    metrics = strategy.stage_metrics() if isinstance(strategy, lnp.NASPipeStrategy) else {}  # collective
    if trainer.global_rank == 0:
        if cfg["exact"]:
            torch.save({k: v.cpu() for k, v in module.state_dict().items()}, cfg["weights"])
        with open(cfg["out"], "w") as f:
            json.dump({"subnets_per_s": clock.subnets / clock.elapsed, "metrics": metrics,
                       "weights": cfg["weights"]}, f)


def _config(name: str, device: str, quick: bool, stages: int = 0, backend: str = "gloo",
            parallel: list[str] | None = None, exact: bool = False, offload: bool = False,
            subnets: int = 0, clip: float | None = None, chunks: int | None = None,
            num_stages: int | None = None) -> dict[str, Any]:
    """One run: ``stages`` processes (0: the plain Trainer), ``num_stages`` of them pipeline stages (the rest
    replicas; ``None``: all)."""
    weights = os.path.join(WEIGHTS_DIR, f"{name}-{stages}-{backend}-{offload}-{len(os.listdir(WEIGHTS_DIR))}.pt")
    return {"weights": weights, "space": name, "device": device, "quick": quick, "stages": stages, "backend": backend,
            "parallel_devices": parallel or [], "exact": exact, "offload": offload, "subnets": subnets,
            "processes": max(stages, 1), "clip": clip, "chunks": chunks, "num_stages": num_stages}


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, str]:
    first, second = torch.load(a["weights"]), torch.load(b["weights"])
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    return not differ and first.keys() == second.keys(), f"{len(differ)} of {len(first)} tensors differ"


def grid_rows(run: Any, add: Any, one: str, gpus: int, quick: bool, space_name: str = "nb201", chunks: int = 4) -> None:
    """Every stages x replicas layout of 2 (and, with 4 GPUs, 4) processes against 1 device: bitwise and speed."""
    subnets = 32 if quick else 64
    base = run(_config(space_name, one, quick, 1, "gloo", [one], exact=True, subnets=subnets, chunks=chunks))
    for processes in (2, 4) if gpus >= 4 else (2,):
        nccl = gpus >= processes
        parallel = [f"cuda:{i}" for i in range(processes)] if nccl else [one] * processes
        for stages in [s for s in range(processes, 0, -1) if processes % s == 0]:
            label = f"grid {stages}x{processes // stages} ({'nccl' if nccl else 'gloo, one device'})"
            cfg = _config(space_name, one, quick, processes, "nccl" if nccl else "gloo", parallel, exact=True,
                          subnets=subnets, chunks=chunks, num_stages=stages)
            result = run(cfg)
            if ok(base) and ok(result):
                same, detail = _same_weights(base, result)
                add((label, space_name, "bitwise" if same else "DIFFERS",
                     f"{detail}; {result['subnets_per_s']:.1f} subnets/s, "
                     f"{result['subnets_per_s'] / base['subnets_per_s']:.2f}x 1 device"))
            else:
                add((label, space_name, "FAILED", result.get("error", base.get("error", ""))[:80]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small spaces, fewer subnets")
    parser.add_argument("--spaces", nargs="+", default=list(SPACES), choices=list(SPACES),
                        help="the zoo spaces of the speed rows")
    add_common_args(parser)
    args = parser.parse_args()
    if ran_as_worker(args, worker):
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; run it on a GPU machine, or --device cpu for a dry run.")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    one = "cuda:0" if args.device == "cuda" else "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, inherited by workers
    rows: list[tuple[str, str, str, str]] = []
    started = time.monotonic()

    def add(row: tuple[str, str, str, str]) -> None:
        """Keep a row and show it at once: a run stopped at its time limit still reports what it finished."""
        rows.append(row)
        print("[gpu_check] | " + " | ".join(row) + f" |  ({time.monotonic() - started:.0f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    def run(cfg: dict[str, Any]) -> dict[str, Any]:
        result = launch(__file__, cfg, timeout=300)
        if not ok(result):
            print(f"[gpu_check] {cfg['space']} stages={cfg['stages']} failed: {result['error']}", file=sys.stderr)
        return result

    def exact_rows(label: str, backend: str, parallel: list[str], spaces: tuple[str, ...] = EXACT_SPACES,
                   clip: float | None = None) -> None:
        for name in spaces:
            subnets = 32 if args.quick else 64
            base = run(_config(name, one, args.quick, exact=True, subnets=subnets, clip=clip))
            piped = run(_config(name, one, args.quick, 2, backend, parallel, exact=True, subnets=subnets, clip=clip))
            if ok(base) and ok(piped):
                same, detail = _same_weights(base, piped)
                add((label, name, "bitwise" if same else "DIFFERS", detail))
            else:
                add((label, name, "FAILED", base.get("error", piped.get("error", ""))[:80]))

    exact_rows("exact gloo (2 processes, one device)", "gloo", [one, one])
    exact_rows("exact, norm clipping (2 processes, one device)", "gloo", [one, one], EXACT_SPACES[:1], clip=1.0)
    if gpus >= 2:
        exact_rows("exact nccl (2 GPUs)", "nccl", ["cuda:0", "cuda:1"])
    else:
        add(("exact nccl (2 GPUs)", "-", "skipped", f"{gpus} GPU(s) here"))
    for name in EXACT_SPACES[:1]:
        plain = run(_config(name, one, args.quick, 2, "gloo", [one, one], exact=True, subnets=32))
        offloaded = run(_config(name, one, args.quick, 2, "gloo", [one, one], exact=True, offload=True, subnets=32))
        if ok(plain) and ok(offloaded):
            same, detail = _same_weights(plain, offloaded)
            m = offloaded["metrics"]
            hits, misses = m.get("offload/prefetch_hits_stage0", 0), m.get("offload/prefetch_misses_stage0", 0)
            peak = m.get("offload/peak_device_bytes_stage0", 0) / max(m.get("offload/partition_bytes_stage0", 1), 1)
            hit_rate = f"{hits / (hits + misses):.0%}" if hits + misses else "n/a (no copies)"
            add(("offload (side stream)", name, "bitwise" if same else "DIFFERS",
                         f"{detail}; prefetch hits {hit_rate}, stall "
                         f"{m.get('offload/stall_seconds_stage0', 0):.2f} s, peak {peak:.0%} of partition"))
        else:
            add(("offload (side stream)", name, "FAILED", offloaded.get("error", plain.get("error", ""))[:80]))
    two = ("nccl", ["cuda:0", "cuda:1"], "2 GPUs, nccl") if gpus >= 2 else ("gloo", [one, one], "one device")
    for name in args.spaces:
        base = run(_config(name, one, args.quick))
        piped = run(_config(name, one, args.quick, 2, two[0], two[1]))
        if ok(base) and ok(piped):
            add((f"speed ({two[2]})", name, f"{piped['subnets_per_s'] / base['subnets_per_s']:.2f}x",
                         f"{base['subnets_per_s']:.1f} -> {piped['subnets_per_s']:.1f} subnets/s"))
        else:
            add((f"speed ({two[2]})", name, "FAILED", piped.get("error", base.get("error", ""))[:80]))
    grid_rows(run, add, one, gpus, args.quick)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"\ngpu_check on {name} ({gpus} GPU(s)), torch {torch.__version__}, {time.monotonic() - started:.0f} s\n")
    print("| check | space | result | detail |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        WEIGHTS_DIR = folder
        main()
