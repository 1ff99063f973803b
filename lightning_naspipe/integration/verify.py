"""``verify``: the promise checked on the user's own code.

:func:`verify` (and ``python train.py verify --config fit.yaml`` with :func:`~lightning_naspipe.naspipe_cli`) trains
a few steps twice, each in fresh processes: with the plain Trainer on one device, and with the Trainer arguments
the user gave (``strategy="naspipe"``, its layout, every flag). Then it compares every weight and buffer, the
optimizer, LR scheduler and callback states, and every point the loggers received (:mod:`.verify_report`).

Fresh processes come from re-running the user's own command (the script or ``python -m`` module and its
arguments) with :data:`ROLE_ENV` set, as Lightning's launcher re-runs it for each extra process; the re-run
reaches the same ``verify`` call (or the CLI's ``verify`` subcommand), which then trains in its role instead. Both
runs log to a recording logger and write checkpoints into a temporary folder, never over the user's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.integration.verify_report import VerifyReport, compare_runs, counts, digest
from lightning_naspipe.namespaces import Namespace, installed, namespace_of
from lightning_naspipe.space.supernet import supernet_of

__all__ = ["verify"]

#: Set in a re-run's environment: its role, folder and steps (JSON).
ROLE_ENV = "LIGHTNING_NASPIPE_VERIFY"
ROLES = ("plain", "pipelined")
#: A process group's variables, left out of a re-run's environment so each run sets up its own.
_DISTRIBUTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK",
                "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Role:
    """What a re-run does: train as ``name`` for ``steps`` steps, writing into ``folder``."""

    name: str
    folder: str
    steps: int

    @property
    def result_path(self) -> Path:
        return Path(self.folder) / f"{self.name}.pt"


def current_role() -> Role | None:
    """This process's role when it is a re-run of :func:`verify`, else ``None``."""
    raw = os.environ.get(ROLE_ENV)
    return Role(**json.loads(raw)) if raw else None


def role_overrides(role: Role, namespace: Namespace) -> dict[str, Any]:
    """Trainer arguments a re-run replaces: the plain run's one device, the steps, a recording logger and a
    folder of its own (``default_root_dir``) for anything written."""
    folder = str(Path(role.folder) / role.name)
    overrides: dict[str, Any] = {"max_steps": role.steps, "logger": _recorder_class(namespace)(folder),
                                 "default_root_dir": folder}
    if role.name == "plain":
        overrides.update(strategy="auto", devices=1, num_nodes=1)
    return overrides


def adopt(trainer: Any, role: Role) -> None:
    """Point the checkpoint callbacks of a re-run's Trainer into its own folder (never over the user's)."""
    for callback in trainer.checkpoint_callbacks:
        callback.dirpath = str(Path(role.folder) / role.name / "checkpoints")


def train_role(trainer: Any, model: Any, role: Role, **fit_kwargs: Any) -> None:
    """Fit ``model`` for the role and save what :func:`compare_runs` compares (on global rank 0)."""
    initial = {name: digest(tensor) for name, tensor in model.state_dict().items()}
    trainer.fit(model, **fit_kwargs)
    if not trainer.is_global_zero:
        return
    recorder = next(logger for logger in trainer.loggers if type(logger).__name__ == "RecordingLogger")
    folder = str(Path(role.folder) / role.name)
    result = {
        "initial": initial,
        "state": {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()},
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        # Callbacks with a state (a progress bar has none, and the strategy's differs in class only)
        "callbacks": {callback.state_key: _without(state, folder) for callback in trainer.callbacks
                      if (state := callback.state_dict()) and not type(callback).__module__.startswith(__package__)},
        "logged": recorder.points,
        "global_step": trainer.global_step,
    }
    torch.save(result, role.result_path)


def rerun_command(arguments: Sequence[str] | None = None) -> list[str]:
    """The command that started this process, ``python <script> <args>`` or ``python -m <module> <args>``, with
    ``arguments`` in place of its own when given."""
    arguments = list(sys.argv[1:] if arguments is None else arguments)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *arguments]
    if not sys.argv or not os.path.isfile(sys.argv[0]):
        raise NASPipeConfigError("verify re-runs your command in fresh processes, so it needs one to re-run: call it "
                                 "from a script (python train.py ...) or a module (python -m ...), not an "
                                 "interactive session or a notebook.")
    return [sys.executable, sys.argv[0], *arguments]


def compare(command: Sequence[str], model: Any, layout: str, steps: int, ignore: Sequence[str] = (),
            timeout: float | None = None) -> VerifyReport:
    """Run ``command`` as the plain and the pipelined role, compare their results; the report.

    The folder of the runs (each run's output, results and anything it wrote) is removed when they are exact
    and kept, and named in the report, when not.

    Raises:
        RuntimeError: a run failed (its output's end is in the message) or wrote no result.
    """
    if steps < 1:
        raise NASPipeConfigError(f"verify needs steps >= 1 to train, got {steps}.")
    folder = tempfile.mkdtemp(prefix="naspipe-verify-")
    results = {role: _run(command, Role(role, folder, steps), timeout) for role in ROLES}
    prefix = _supernet_prefix(model)
    differences = compare_runs(results["plain"], results["pipelined"], ignore,
                               outside_supernet=lambda name: not name.startswith(prefix),
                               describe_step=lambda step: _describe_step(model, step))
    if differences:
        layout = f"{layout} (runs kept in {folder})"
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return VerifyReport(tuple(differences), counts(results["plain"]), layout, steps)


def verify(model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None, datamodule: Any = None, *,
           steps: int = 20, ignore: Sequence[str] = (), timeout: float | None = None,
           **trainer_kwargs: Any) -> VerifyReport:
    """Check that training ``model`` with these Trainer arguments equals the plain Trainer, bit for bit.

    Trains ``steps`` steps twice, each in fresh processes started by re-running this script: with the plain
    Trainer on one device, and with ``trainer_kwargs`` (e.g. ``strategy="naspipe", devices=2``). Compares every
    weight, buffer, optimizer, LR scheduler and callback state and every logged point. The re-runs build the
    module as this process did, so seed before building it. Both run with this environment's
    ``OMP_NUM_THREADS`` (1 when unset): CPU kernels' results depend on their thread count.

    Call it from a script guarded by ``if __name__ == "__main__":``; in a re-run the call trains and exits.

    Args:
        model: the LightningModule (with :class:`~lightning_naspipe.NASPipeMixin`).
        train_dataloaders: as for ``Trainer.fit``.
        val_dataloaders: as for ``Trainer.fit``.
        datamodule: as for ``Trainer.fit``.
        steps: training steps (subnets, with one per step) of each run.
        ignore: logged names (``fnmatch`` patterns) not compared, e.g. timings.
        timeout: seconds each run may take (``None``: no limit).
        **trainer_kwargs: the Trainer arguments of the run to check. ``logger``, ``max_steps`` and
            ``default_root_dir`` are replaced, and checkpoints go to a temporary folder.

    Returns:
        The report: ``report.exact``, ``report.first`` (the first divergence), ``report.summary()``.

    Raises:
        RuntimeError: a run failed; the message ends with its output.
    """
    role = current_role()
    fit_kwargs = dict(train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders, datamodule=datamodule)
    if role is not None:
        namespace = namespace_of(type(model)) or installed()[0]
        trainer = namespace.pytorch.Trainer(**{**trainer_kwargs, **role_overrides(role, namespace)})
        adopt(trainer, role)
        train_role(trainer, model, role, **fit_kwargs)
        raise SystemExit(0)
    strategy = trainer_kwargs.get("strategy", "auto")
    strategy = strategy if isinstance(strategy, str) else type(strategy).__name__
    layout = f"{strategy} on devices={trainer_kwargs.get('devices', 'auto')!r} vs the plain Trainer"
    return compare(rerun_command(), model, layout, steps, ignore, timeout)


def _run(command: Sequence[str], role: Role, timeout: float | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED}
    env[ROLE_ENV] = json.dumps({"name": role.name, "folder": role.folder, "steps": role.steps})
    env.setdefault("OMP_NUM_THREADS", "1")
    log = Path(role.folder) / f"{role.name}.log"
    with open(log, "w") as output:
        try:
            code = subprocess.run(list(command), env=env, stdout=output, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not role.result_path.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        happened = "ran past the timeout" if code is None else f"exited with {code}" if code else "saved no result"
        raise RuntimeError(f"verify: the {role.name} run ({' '.join(command)}) {happened}; its output ends:\n{tail}")
    return torch.load(role.result_path, weights_only=False)  # type: ignore[no-any-return]


def _without(state: Any, folder: str) -> Any:
    """``state`` with the run's own folder taken out of its strings (a checkpoint callback's paths)."""
    if isinstance(state, str):
        return state.replace(folder, "<run>")
    if isinstance(state, dict):
        return {key: _without(value, folder) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_without(value, folder) for value in state)
    return state


def _supernet_prefix(model: Any) -> str:
    supernet = supernet_of(model)
    return next(f"{name}." for name, module in model.named_modules() if module is supernet)


def _describe_step(model: Any, step: int) -> str:
    try:
        subnets = [dict(architecture) for architecture in model.sample_step(step)]
    except Exception:  # a sampler that needs the Trainer: the step alone says enough
        return ""
    return f"subnet {subnets[0]}" if len(subnets) == 1 else f"subnets {subnets}"


@cache
def _recorder_class(namespace: Namespace) -> type:
    base = namespace.pytorch.loggers.Logger

    class RecordingLogger(base):  # type: ignore[misc, valid-type]
        """Keeps every logged point, ``(step, name, value)``, in memory; ``folder`` is the run's own."""

        def __init__(self, folder: str) -> None:
            super().__init__()
            self.folder = folder
            self.points: list[tuple[int | None, str, float]] = []

        @property
        def save_dir(self) -> str:
            return self.folder  # LightningCLI saves the run's config there

        @property
        def name(self) -> str:
            return "naspipe_verify"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            self.points += [(step, name, float(value)) for name, value in metrics.items()]

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass  # the strategy's own settings (its layout) are no training result

    return RecordingLogger
