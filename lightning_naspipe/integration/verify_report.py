"""What :func:`~lightning_naspipe.verify` compares: two runs' results, and the report of where they differ.

A run's result (:func:`run_result`) holds the initial weights' digests, every weight and buffer, the optimizer,
LR scheduler and callback states after training, and every point the loggers received. :func:`compare_runs` is
pure: it lists every difference, the first divergence first (initial weights, then the earliest logged step, then
tensors and states), each with the likely cause where the kind of difference tells it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Difference", "VerifyReport", "compare_runs"]

#: Logged names only the strategy logs (its offload and telemetry accounting, per stage).
STRATEGY_ONLY = ("offload/*", "telemetry/*")

SEED_CAUSE = ("the two runs start from different weights: the module is not built the same way in every process. "
              "Seed before building it (seed_everything(...) in the script, or seed_everything: <int> in the CLI "
              "config).")
MISSING_LOG_CAUSE = ("logged on the plain Trainer but not (or not at every step) on the pipelined run: a hook that "
                     "runs only on the stage owning the blocks (on_before_backward, on_after_backward, "
                     "on_before_optimizer_step) or once per window (on_train_batch_start/end). Log per subnet from "
                     "compute_loss or on_train_subnet_end instead.")
OUTSIDE_CAUSE = ("state outside the supernet differs: an attribute or buffer set in compute_loss or a hook changes "
                 "only in the process that runs it. Keep training state in the supernet's blocks, or log it.")
CALLBACK_CAUSE = ("a callback's state differs: a callback that reads weights or gradients at every batch sees a "
                  "window of subnets at a time under the strategy (weight averaging such as EMA does).")
PROCESS_CAUSE = ("the training itself differs from the first step: a block or compute_loss depends on the process "
                 "(its rank, device or a per-process state), or on randomness NASPipe does not key (a generator "
                 "the module created itself).")


@dataclass(frozen=True)
class Difference:
    """One thing that differs between the plain run and the pipelined one.

    Attributes:
        kind: ``"initial weights"``, ``"steps"``, ``"logged"``, ``"tensor"``, ``"optimizer"``, ``"scheduler"``
            or ``"callback"``.
        name: the tensor, logged metric, or state path.
        step: the global step of a logged point (the subnet's index with one subnet per step), else ``None``.
        detail: the two values, or what is missing.
        cause: the likely cause, where the kind of difference tells it.
    """

    kind: str
    name: str
    step: int | None
    detail: str
    cause: str | None = None

    def describe(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        return f"{self.kind} '{self.name}'{at}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`~lightning_naspipe.verify`.

    Attributes:
        differences: everything that differs, the first divergence first; empty when the runs are exact.
        compared: how many tensors, states and logged points were compared, by kind.
        layout: what was compared with the plain Trainer, in words.
        steps: the training steps each run took.
    """

    differences: tuple[Difference, ...]
    compared: dict[str, int]
    layout: str
    steps: int

    @property
    def exact(self) -> bool:
        """Whether the pipelined run equals the plain one bit for bit."""
        return not self.differences

    @property
    def first(self) -> Difference | None:
        """The first divergence, or ``None`` when exact."""
        return self.differences[0] if self.differences else None

    @property
    def exit_code(self) -> int:
        """0 when exact, else 1 (what ``verify`` on the command line exits with)."""
        return 0 if self.exact else 1

    def summary(self) -> str:
        counted = ", ".join(f"{count} {kind}" for kind, count in self.compared.items())
        head = f"verify: {self.layout}, {self.steps} steps; compared {counted}"
        if self.exact:
            return f"{head}\nexact: every tensor, state and logged point is bitwise equal to the plain Trainer's"
        first = self.differences[0]
        kinds: dict[str, int] = {}
        for difference in self.differences:
            kinds[difference.kind] = kinds.get(difference.kind, 0) + 1
        lines = [head, "NOT exact: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + " differ",
                 f"first divergence: {first.describe()}"]
        if first.cause:
            lines.append(f"likely cause: {first.cause}")
        lines += [f"  also: {d.describe()}" for d in self.differences[1:6]]
        if len(self.differences) > 6:
            lines.append(f"  ... and {len(self.differences) - 6} more")
        return "\n".join(lines)


def digest(tensor: torch.Tensor) -> str:
    """A tensor's dtype, shape and bytes, hashed (the initial weights are compared by digest)."""
    data = tensor.detach().cpu().contiguous()
    raw = data.view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
    return hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode() + raw.numpy().tobytes()).hexdigest()


def compare_runs(plain: dict[str, Any], pipelined: dict[str, Any], ignore: Sequence[str] = (),
                 outside_supernet: Callable[[str], bool] = lambda name: False,
                 describe_step: Callable[[int], str] = lambda step: "") -> list[Difference]:
    """Every difference between two :func:`run_result` dicts, the first divergence first.

    Args:
        plain: the plain Trainer's result.
        pipelined: the strategy's result.
        ignore: logged names (``fnmatch`` patterns) not compared, besides the strategy's own accounting.
        outside_supernet: whether a state-dict name is outside the supernet (its differences get that cause).
        describe_step: words for a step (e.g. its subnet's architecture), added to logged differences.
    """
    initial = [Difference("initial weights", name, None, "differs before training", SEED_CAUSE)
               for name in _differing_keys(plain["initial"], pipelined["initial"], lambda a, b: a == b)]
    if initial:
        return initial
    found: list[Difference] = []
    if plain["global_step"] != pipelined["global_step"]:
        found.append(Difference("steps", "global_step", None,
                                f"plain {plain['global_step']} vs pipelined {pipelined['global_step']}"))
    found += _logged(plain["logged"], pipelined["logged"], tuple(ignore) + STRATEGY_ONLY, describe_step)
    tensors = [Difference("tensor", name, None, _tensor_detail(plain["state"].get(name), pipelined["state"].get(name)),
                          OUTSIDE_CAUSE if outside_supernet(name) else None)
               for name in _differing_keys(plain["state"], pipelined["state"], _same)]
    found += sorted(tensors, key=lambda d: d.cause is None)  # state outside the supernet explains the rest
    for kind, key in (("optimizer", "optimizers"), ("scheduler", "schedulers"), ("callback", "callbacks")):
        found += [Difference(kind, path, None, detail, CALLBACK_CAUSE if kind == "callback" else None)
                  for path, detail in _nested(plain[key], pipelined[key], key)]
    if found and found[0].cause is None and found[0].kind == "logged" and found[0].step == _first_step(plain):
        found[0] = Difference(found[0].kind, found[0].name, found[0].step, found[0].detail, PROCESS_CAUSE)
    elif found and found[0].cause is None and found[0].kind == "tensor":
        found[0] = Difference("tensor", found[0].name, None, found[0].detail, PROCESS_CAUSE)
    return found


def counts(result: dict[str, Any]) -> dict[str, int]:
    """How many things of each kind a result holds (the report's "compared")."""
    return {"tensors": len(result["state"]), "logged points": len(result["logged"]),
            "optimizer states": len(result["optimizers"]), "scheduler states": len(result["schedulers"]),
            "callback states": len(result["callbacks"])}


def _first_step(result: dict[str, Any]) -> int | None:
    steps = [step for step, _, _ in result["logged"] if step is not None]
    return min(steps) if steps else None


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and bool(torch.equal(a, b)))


def _differing_keys(a: dict[str, Any], b: dict[str, Any], same: Callable[[Any, Any], bool]) -> list[str]:
    names = list(a) + [name for name in b if name not in a]
    return [name for name in names if name not in a or name not in b or not same(a[name], b[name])]


def _tensor_detail(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return "only in the " + ("pipelined" if a is None else "plain") + " run"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"plain {a.dtype} {tuple(a.shape)} vs pipelined {b.dtype} {tuple(b.shape)}"
    unequal = a != b
    share = f"{int(unequal.sum())} of {a.numel()} elements"
    if a.is_floating_point():
        return f"{share} differ, max |difference| {float((a.double() - b.double()).abs().max()):.3g}"
    return f"{share} differ"


def _logged(plain: list[tuple[int | None, str, float]], pipelined: list[tuple[int | None, str, float]],
            ignore: tuple[str, ...], describe_step: Callable[[int], str]) -> list[Difference]:
    """The first difference of each logged name, ordered by step."""
    def series(points: list[tuple[int | None, str, float]]) -> dict[str, list[tuple[int | None, float]]]:
        named: dict[str, list[tuple[int | None, float]]] = {}
        for step, name, value in points:
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore):
                named.setdefault(name, []).append((step, value))
        return named

    a, b = series(plain), series(pipelined)
    found = []
    for name in list(a) + [n for n in b if n not in a]:
        first = _first_mismatch(a.get(name, []), b.get(name, []))
        if first is None:
            continue
        step, detail, missing = first
        where = describe_step(step) if step is not None else ""
        found.append(Difference("logged", name, step, detail + (f" ({where})" if where else ""),
                                MISSING_LOG_CAUSE if missing else None))
    return sorted(found, key=lambda d: -1 if d.step is None else d.step)


def _first_mismatch(a: list[tuple[int | None, float]], b: list[tuple[int | None, float]]
                    ) -> tuple[int | None, str, bool] | None:
    for (step_a, value_a), (step_b, value_b) in zip(a, b):
        if step_a != step_b:
            known = [s for s in (step_a, step_b) if s is not None]
            return (min(known) if known else None,
                    f"logged at step {step_a} on the plain run, at step {step_b} on the pipelined", True)
        if not (value_a == value_b or (math.isnan(value_a) and math.isnan(value_b))):
            return step_a, f"plain {value_a!r} vs pipelined {value_b!r}", False
    if len(a) != len(b):
        longer, which = (a, "plain") if len(a) > len(b) else (b, "pipelined")
        step = longer[min(len(a), len(b))][0]
        return step, f"{len(a)} points on the plain run, {len(b)} on the pipelined (from here on only the {which})", \
            True
    return None


def _nested(a: Any, b: Any, where: str) -> Iterator[tuple[str, str]]:
    """(path, detail) for every leaf that differs between two nested states."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not _same(a, b):
            yield where, (_tensor_detail(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                          else f"plain {type(a).__name__} vs pipelined {type(b).__name__}")
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                yield f"{where}.{key}", "only in the " + ("pipelined" if key not in a else "plain") + " run"
            else:
                yield from _nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b)):
            yield from _nested(x, y, f"{where}[{index}]")
    elif not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))):
        yield where, f"plain {a!r} vs pipelined {b!r}"
