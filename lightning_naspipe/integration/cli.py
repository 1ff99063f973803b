"""``naspipe_cli``: LightningCLI with ``search`` and ``verify`` subcommands that read the same config file as ``fit``.

::

    python train.py verify --config run.yaml --steps 20     # exact, or the first divergence (exit status 1)

    python train.py fit    --config run.yaml
    python train.py search --config run.yaml --ckpt_path runs/supernet.ckpt --max_flops 2000000
    python train.py search --config run.yaml --ckpt_path runs/supernet.ckpt --latency_table latency.json \
        --max_latency_ms 3.0

``search`` is a method of a Trainer subclass made here (LightningCLI builds a subcommand's
arguments from the Trainer method of that name). It loads the checkpoint on every process with a
``validate`` run of no batches, which launches the stage processes as ``fit`` does, then calls
:func:`lightning_naspipe.search` on all of them.

The config ``fit`` saved in its log folder is a valid ``search`` config, and a search never writes
over what ``fit`` left there: a logger with a fixed version logs the search to a ``search``
sub-folder of its folder (an automatic version is the next ``version_N`` anyway), and the search's
config is saved as ``search_config.yaml``, not ``config.yaml``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import warnings
from functools import cache
from typing import Any, Optional, Union

from lightning_naspipe.compat import lightning
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.integration.strategy import NASPipeStrategy
from lightning_naspipe.integration.verify import adopt, compare, current_role, rerun_command, role_overrides, train_role
from lightning_naspipe.searching.constraints import Constraints
from lightning_naspipe.searching.export import save_subnet
from lightning_naspipe.searching.latency import LatencyTable, batch_size_of
from lightning_naspipe.space.freezing import recalibrate_batchnorm
from lightning_naspipe.namespaces import Namespace, installed, namespace_of
from lightning_naspipe.searching.search_loop import SearchResult, search
from lightning_naspipe.searching.searchers import EvolutionSearch, GridSearch, RandomSearch, SPOSSearch
from lightning_naspipe.space.boundary import map_tensors
from lightning_naspipe.space.supernet import supernet_of

__all__ = ["naspipe_cli"]

#: Where the CLI keeps the arguments it parsed, and the ``verify`` subcommand's Trainer the command its runs re-run.
_ARGUMENTS, _VERIFY_COMMAND = "_naspipe_arguments", "_naspipe_verify_command"

#: What ``--searcher`` accepts (``class_path`` and ``init_args`` in a config file).
AnySearcher = Union[RandomSearch, EvolutionSearch, SPOSSearch, GridSearch]


def naspipe_cli(model_class: Any = None, datamodule_class: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Run a LightningCLI that also has the ``search`` subcommand.

    Takes LightningCLI's arguments. The CLI is the one of the namespace the model class is built on
    (``lightning.pytorch`` or ``pytorch_lightning``); ``trainer_class`` must be a Trainer subclass.

    Returns:
        The LightningCLI instance, as ``LightningCLI(...)`` does.
    """
    namespace = namespace_of(model_class) or namespace_of(datamodule_class) or installed()[0]
    return _cli_class(namespace)(model_class, datamodule_class, *args, **kwargs)


@cache
def _cli_class(namespace: Namespace) -> Any:
    base = namespace.pytorch_module("cli").LightningCLI
    default_trainer = namespace.pytorch.Trainer

    class NASPipeCLI(base):  # type: ignore[misc, valid-type]
        """LightningCLI with a ``search`` subcommand."""

        save_config_kwargs: dict[str, Any]  # LightningCLI's, set in its __init__

        def __init__(self, *args: Any, trainer_class: Any = default_trainer, **kwargs: Any) -> None:
            super().__init__(*args, trainer_class=_with_search(trainer_class), **kwargs)

        def parse_arguments(self, parser: Any, args: Any) -> None:
            self.__dict__[_ARGUMENTS] = args  # what verify's runs re-run (None: sys.argv)
            super().parse_arguments(parser, args)

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            if self.subcommand == "verify":
                return self._verify_trainer(**kwargs)
            if self.subcommand != "search":
                return super().instantiate_trainer(**kwargs)
            saved = self.save_config_kwargs
            # The config fit saved is often the one this search was given: never write over it. A search
            # saves its own under its own name, replacing that of a previous search there (a resumed one).
            name = "search_" + os.path.basename(saved.get("config_filename", "config.yaml"))
            self.save_config_kwargs = {**saved, "config_filename": name, "overwrite": True}
            try:
                trainer = super().instantiate_trainer(**kwargs)
            finally:
                self.save_config_kwargs = saved
            _own_log_folders(trainer, namespace)
            return trainer

        def _verify_trainer(self, **kwargs: Any) -> Any:
            role = current_role()
            if role is None:  # the command the runs re-run, with the seed LightningCLI resolved (it may be random)
                arguments = self.__dict__.get(_ARGUMENTS)
                if arguments is not None and not isinstance(arguments, (list, tuple)):
                    raise NASPipeConfigError("verify re-runs the command line, so naspipe_cli(args=...) must be a "
                                             f"list of command-line arguments, not a {type(arguments).__name__}.")
                command = rerun_command(arguments)
                seed = self.config[self.subcommand].get("seed_everything")
                if seed is not None and not isinstance(seed, bool):
                    command.append(f"--seed_everything={seed}")
                trainer = super().instantiate_trainer(**kwargs)
                trainer.__dict__[_VERIFY_COMMAND] = command
                return trainer
            trainer = super().instantiate_trainer(**{**kwargs, **role_overrides(role, namespace)})
            adopt(trainer, role)
            return trainer

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            return {**base.subcommands(), "search": {"model", "datamodule"}, "verify": {"model", "datamodule"}}

    return NASPipeCLI


@cache
def _with_search(trainer_class: Any) -> Any:
    if not isinstance(trainer_class, type):
        raise NASPipeConfigError(f"naspipe_cli needs trainer_class to be a Trainer class, got {trainer_class!r}; "
                                 "pass a Trainer subclass rather than a function that builds one.")
    if hasattr(trainer_class, "search") and hasattr(trainer_class, "verify"):
        return trainer_class
    return type(trainer_class.__name__, (trainer_class,), {"search": _search, "verify": _verify,
                                                          "__module__": __name__, "__doc__": trainer_class.__doc__})


def _own_log_folders(trainer: Any, namespace: Namespace) -> None:
    """Point each CSV or TensorBoard logger with a fixed version at a ``search`` sub-folder of its folder.

    Such a logger would otherwise log the search into fit's folder, whose ``metrics.csv`` the CSV
    logger deletes when it starts. An automatic version (``None``) already gives a new folder.
    """
    loggers = namespace.fabric_module("loggers")
    for logger in trainer.loggers:
        if not isinstance(logger, (loggers.CSVLogger, loggers.TensorBoardLogger)):
            continue
        version = lightning.fixed_logger_version(logger)  # or None; `version` would pick the next free one
        if version is None or lightning.logger_started(logger):
            continue  # a new version_N, or a run already writing where it writes
        folder = version if isinstance(version, str) else f"version_{version}"
        lightning.set_logger_version(logger, os.path.join(folder, "search") if folder else "search")


def _search(self: Any, model: Any, datamodule: Any = None, ckpt_path: Optional[str] = None,
            searcher: AnySearcher = RandomSearch(64), calibration_batches: int = 0,
            max_params: Optional[int] = None, max_flops: Optional[int] = None, log_path: Optional[str] = None,
            plot_path: Optional[str] = None, export_path: Optional[str] = None,
            weights_only: Optional[bool] = None, constraints: Optional[Constraints] = None,
            latency_table: Optional[str] = None, max_latency_ms: Optional[float] = None) -> SearchResult:
    """Search the trained supernet of a checkpoint for the best subnet.

    Scores come from the validation dataloader (see ``lightning_naspipe.search``).

    Args:
        model: the LightningModule (from the config).
        datamodule: the LightningDataModule (from the config), or None to use the module's loaders.
        ckpt_path: the checkpoint of the trained supernet.
        searcher: which architectures to evaluate, e.g. ``{"class_path": "lightning_naspipe.SPOSSearch",
            "init_args": {"population": 20}}``.
        calibration_batches: recompute each candidate's BatchNorm statistics on this many training
            batches first (0: keep the supernet's statistics).
        max_params: only subnets with at most this many parameters.
        max_flops: only subnets with at most this many FLOPs per sample.
        log_path: a JSON-lines log of the evaluations; an interrupted search resumes from it.
        plot_path: write a PNG of score against FLOPs with the Pareto front here (needs matplotlib).
        export_path: save the best subnet here (``lightning_naspipe.save_subnet``).
        weights_only: how the checkpoint is loaded, as for ``Trainer.validate`` (``fit`` saves it in
            its config, so the config fit saved is a valid search config).
        constraints: ``lightning_naspipe.Constraints`` as ``init_args``: ranges of parameters, FLOPs and
            latency, ``latency`` (a saved table's path, or ``measured``) and a ``penalty``
            (``{"target_ms": ...}``).
        latency_table: a ``LatencyTable`` JSON file (``python -m lightning_naspipe latency`` writes one).
        max_latency_ms: only subnets whose latency is at most this (needs a table or measured latency; with a
            table the best is checked end to end before it is returned, see lnp.search).
    """
    if ckpt_path is None:
        raise NASPipeConfigError("search needs --ckpt_path: the checkpoint of the trained supernet (fit writes it).")
    limit = self.limit_val_batches
    self.limit_val_batches = 0  # the validate run only launches the processes and loads the checkpoint
    try:
        self.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=weights_only)
    finally:
        self.limit_val_batches = limit
    loaders = datamodule if datamodule is not None else model
    calibration: list[Any] | None = None
    if calibration_batches > 0:
        if datamodule is not None:
            datamodule.setup("fit")
        # Read once: the exported subnet gets the statistics its score was computed with.
        calibration = list(itertools.islice(loaders.train_dataloader(), calibration_batches))
    table = LatencyTable.load(latency_table) if latency_table is not None else None
    result = search(self, model, searcher, loaders.val_dataloader(), calibration=calibration,
                    max_params=max_params, max_flops=max_flops, log_path=log_path, latency=table,
                    max_latency_ms=max_latency_ms, constraints=constraints)
    if self.is_global_zero:
        _report(result, searcher)
        if plot_path is not None:
            axis = "latency" if result.history[0].latency_ms is not None else "FLOPs"
            print(f"score against {axis}: {result.plot(plot_path)}")
        if export_path is not None:
            repeats = constraints.repeats if constraints is not None else 10
            used = table if table is not None else constraints.table if constraints is not None else None
            size = used.batch_size if used is not None else None
            saved = _export(model, result, loaders, calibration, export_path, repeats, size)
            timed = "" if size is None else f" (latency timed at batch size {size}, the latency table's)"
            print(f"best subnet saved to {saved}{timed}")
    return result


def _verify(self: Any, model: Any, datamodule: Any = None, steps: int = 20, ignore: Optional[list[str]] = None,
            timeout: Optional[float] = None) -> None:
    """Train ``steps`` steps with the plain Trainer and with this config's strategy, each in fresh processes, and
    compare every weight, state and logged point (``lightning_naspipe.verify``). Prints ``exact`` or the first
    divergence and its likely cause; exits 0 only when exact.

    Args:
        model: the LightningModule (from the config).
        datamodule: the LightningDataModule (from the config), or None to use the module's loaders.
        steps: training steps of each run.
        ignore: logged names (fnmatch patterns) not compared, e.g. timings.
        timeout: seconds each run may take.
    """
    role = current_role()
    if role is not None:
        train_role(self, model, role, datamodule=datamodule)
        return
    command = self.__dict__[_VERIFY_COMMAND]
    strategy = "NASPipeStrategy" if isinstance(self.strategy, NASPipeStrategy) else type(self.strategy).__name__
    layout = f"{strategy} on {self.num_devices * self.num_nodes} device(s) vs the plain Trainer"
    try:
        report = compare(command, model, layout, steps, ignore or (), timeout)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    print(report.summary())
    raise SystemExit(report.exit_code)


def _report(result: SearchResult, searcher: Any) -> None:
    best = result.best_record
    initial = result.history[:getattr(searcher, "population", len(result.history))]
    print("\n".join(result.table().splitlines()[:11]))
    latency = "" if best.latency_ms is None else f", {best.latency_ms:.4f} ms ({best.latency_kind})"
    latency += "" if best.measured_latency_ms is None else f", {best.measured_latency_ms:.4f} ms (measured)"
    penalized = "" if best.penalized_score is None else f" (penalized {best.penalized_score:.6g})"
    print(f"best of {len(result.history)}: score {best.score:.6g}{penalized}, {best.params} params, "
          f"{best.flops / 1e6:.3f} MFLOPs{latency}, architecture {best.architecture}; median of the first "
          f"{len(initial)} (random) candidates: {statistics.median(r.score for r in initial):.6g}")


def _export(model: Any, result: SearchResult, loaders: Any, calibration: list[Any] | None, folder: str,
            repeats: int, batch_size: int | None = None) -> Any:
    """Save the best subnet with its latency timed on a validation batch; at ``batch_size`` (a latency table's)
    when given, so the recorded latency compares with the table's predictions."""
    net = supernet_of(model).freeze(result.best)
    if calibration:
        recalibrate_batchnorm(net, calibration, forward=lambda batch: net(model.pipeline_input(batch)))
    example = model.pipeline_input(next(iter(loaders.val_dataloader())))
    given = batch_size_of(example)
    if batch_size is not None and given > batch_size:  # every tensor's first dimension is the batch (as exported)
        example = map_tensors(lambda t: t[:batch_size] if t.dim() else t, example)
    elif batch_size is not None and given < batch_size:
        warnings.warn(f"search --export_path: the validation batch holds {given} samples, fewer than the latency "
                      f"table's batch size {batch_size}: the exported subnet's latency is timed at {given} and does "
                      "not compare with the table's predictions. Validate with batches of at least "
                      f"{batch_size}, or build the table at {given}.", stacklevel=2)
    # The folder records the subnet's latency measured end to end, with the device and batch size.
    return save_subnet(net.eval(), folder, example, result.best, latency_repeats=repeats)
