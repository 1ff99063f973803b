"""Every private Lightning name NASPipe reaches and every runtime patch on Lightning objects, by name.

The rest of the package calls these accessors (``integration`` only: see ``tests/test_layers.py``); each is
guarded in ``tests/test_private_apis.py`` (docs/design.md's table), and :func:`require_internals` checks them
all at ``NASPipeStrategy.setup``, before any collective, refusing a Lightning that lacks one. Objects are
either namespace's (``lightning.pytorch`` or ``pytorch_lightning``): nothing here imports one statically.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import Namespace

#: The Lightning releases NASPipe supports: pyproject.toml's bounds of ``lightning`` and ``pytorch-lightning``
#: (below the next minor while exactness relies on these internals; ``tests/test_loop_state.py`` checks they agree).
SUPPORTED_LOW, SUPPORTED_HIGH = "2.6", "2.7"
SUPPORTED = (f"lightning>={SUPPORTED_LOW},<{SUPPORTED_HIGH} (or pytorch-lightning>={SUPPORTED_LOW},"
             f"<{SUPPORTED_HIGH})")
#: The loggers' step in a checkpoint's ``fit_loop["epoch_loop.state_dict"]``.
LOGGER_STEP_KEY = "_batches_that_stepped"


def swap_class(obj: object, cls: type) -> None:
    """Make ``obj`` an instance of ``cls`` (a subclass of its class, or back). A patch: Lightning has no hook to
    choose the class of the strategy it binds, of its progress bar or of the running Trainer."""
    obj.__class__ = cls


# -- the fit loop and logging ----------------------------------------------------------------------


def batches_that_stepped(trainer: Any) -> int:
    """The loggers' step (``fit_loop.epoch_loop._batches_that_stepped``)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def set_batches_that_stepped(trainer: Any, step: int) -> None:
    """Set the loggers' step, which the logger connector reads."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def has_logging_internals(trainer: Any) -> bool:
    """Whether ``trainer`` has the loggers' step and the result collection the window logging uses."""
    return hasattr(trainer.fit_loop.epoch_loop, LOGGER_STEP_KEY) and hasattr(trainer, "_results")


def results(trainer: Any) -> Any:
    """The running loop's ``_ResultCollection`` (``trainer._results``)."""
    return trainer._results


def epoch_loop_results(trainer: Any) -> Any:
    """The training epoch loop's ``_ResultCollection``."""
    return trainer.fit_loop.epoch_loop._results


def logger_connector(trainer: Any) -> Any:
    """The Trainer's logger connector."""
    return trainer._logger_connector


def connector_fx(connector: Any) -> Any:
    """The hook the logger connector logs for."""
    return connector._current_fx


def set_connector_fx(connector: Any, fx: Any) -> None:
    """Set the hook the logger connector logs for."""
    connector._current_fx = fx


def current_fx_name(module: Any) -> Any:
    """The hook ``self.log`` registers a metric under (``None`` outside hooks, or on a non-Lightning module)."""
    return getattr(module, "_current_fx_name", None)


def set_current_fx_name(module: Any, name: Any) -> None:
    """Set the hook ``self.log`` registers a metric under."""
    module._current_fx_name = name


def should_check_val_epoch(trainer: Any) -> bool:
    """Whether the running epoch validates at its end."""
    return bool(trainer.fit_loop.epoch_loop._should_check_val_epoch())


def lr_monitor_stats(monitor: Any, trainer: Any, interval: str) -> Any:
    """What a ``LearningRateMonitor``'s ``on_train_batch_start`` logs."""
    return monitor._extract_stats(trainer, interval)


def every_n_train_steps(callback: Any) -> int:
    """A ``ModelCheckpoint``'s step interval (0: none)."""
    return int(getattr(callback, "_every_n_train_steps", 0))


# -- signals ---------------------------------------------------------------------------------------


def signal_handlers(trainer: Any) -> tuple[Any, Any]:
    """The signal connector's SIGTERM handler and its SLURM requeue handler."""
    connector = trainer._signal_connector
    return connector._sigterm_notifier_fn, connector._slurm_sigusr_handler_fn


def cluster_environment(trainer: Any) -> Any:
    """The Trainer's cluster environment."""
    return trainer._accelerator_connector.cluster_environment


def replace_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> None:
    """Run ``check`` where the epoch loop broadcasts SIGTERM before each batch. A patch: Lightning has no hook
    there, and its broadcast is a collective the stages could not agree on at that point."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check


def mark_sigterm_received(trainer: Any) -> None:
    """Tell the signal connector that SIGTERM arrived."""
    trainer._signal_connector.received_sigterm = True


# -- modules, optimizers, loggers, checkpoint IO ---------------------------------------------------


def is_attached(module: Any) -> bool:
    """Whether a Trainer holds ``module`` (its ``trainer`` property raises otherwise)."""
    return module._trainer is not None


def set_module_device(module: Any, device: torch.device) -> None:
    """Set what ``module.device`` reports."""
    module._device = device


def wrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ``LightningOptimizer`` wraps (``optimizer`` itself when it wraps none)."""
    return getattr(optimizer, "_optimizer", optimizer)


def fixed_logger_version(logger: Any) -> Any:
    """The version a fabric ``CSVLogger``/``TensorBoardLogger`` was given (``None``: the next free one)."""
    return logger._version


def logger_started(logger: Any) -> bool:
    """Whether the logger already writes."""
    return getattr(logger, "_experiment", None) is not None


def set_logger_version(logger: Any, version: str) -> None:
    """Make the logger write under ``version``."""
    logger._version = version


def wrapping_checkpoint_io(namespace: Namespace) -> Any:
    """The base class of wrapping checkpoint IOs (e.g. ``AsyncCheckpointIO``)."""
    return namespace.pytorch_module("plugins.io.wrapper")._WrappingCheckpointIO


def set_plugins(strategy: Any, accelerator: Any, precision_plugin: Any, checkpoint_io: Any) -> None:
    """Give an unbound strategy the plugins ``Strategy.__init__`` would set."""
    strategy._accelerator, strategy._precision_plugin = accelerator, precision_plugin
    strategy._checkpoint_io = checkpoint_io


def strategy_checkpoint_io(strategy: Any) -> Any:
    """The checkpoint IO a strategy holds (``None``: the default)."""
    return strategy._checkpoint_io


def set_strategy_checkpoint_io(strategy: Any, io: Any) -> None:
    """Set the checkpoint IO a strategy holds."""
    strategy._checkpoint_io = io


def strategy_accelerator(strategy: Any) -> Any:
    """The accelerator a strategy holds."""
    return strategy._accelerator


def set_strategy_accelerator(strategy: Any, accelerator: Any) -> None:
    """Set the accelerator a strategy holds."""
    strategy._accelerator = accelerator


@contextlib.contextmanager
def replaced_clip_gradients(plugin: Any, clip_gradients: Callable[..., None]) -> Iterator[None]:
    """Make ``plugin``'s ``Precision._clip_gradients`` (called by ``_after_closure`` after the
    ``on_before_optimizer_step`` hooks) call ``clip_gradients`` for the body. A patch on this instance only:
    Lightning skips its clipping call under manual optimization and has no hook there."""
    shadowed = plugin.__dict__.get("_clip_gradients")
    plugin._clip_gradients = clip_gradients
    try:
        yield
    finally:
        if shadowed is None:
            del plugin._clip_gradients
        else:
            plugin._clip_gradients = shadowed


def has_clip_gradients(plugin: Any) -> bool:
    """Whether ``plugin``'s class has ``Precision._clip_gradients``."""
    return callable(getattr(type(plugin), "_clip_gradients", None))


# -- launchers and the process group ---------------------------------------------------------------


class LauncherHook:
    """Lightning's private ``Strategy._configure_launcher`` as a public hook: the strategy's
    ``choose_launcher()`` returns the launcher (``None``: launch nothing)."""

    _launcher: Any

    def choose_launcher(self) -> Any:
        """The launcher of this strategy's processes, or ``None``."""
        raise NotImplementedError

    def _configure_launcher(self) -> None:
        self._launcher = self.choose_launcher()


def subprocess_launcher(namespace: Namespace, environment: Any, num_processes: int, num_nodes: int) -> Any:
    """Lightning's popen launcher (a script re-run per process)."""
    launchers = namespace.pytorch_module("strategies.launchers")
    return launchers._SubprocessScriptLauncher(environment, num_processes, num_nodes)


def multiprocessing_launcher(namespace: Namespace, strategy: Any, start_method: str) -> Any:
    """Lightning's multiprocessing launcher (spawn, fork, forkserver)."""
    return namespace.pytorch_module("strategies.launchers")._MultiProcessingLauncher(strategy,
                                                                                     start_method=start_method)


def launched_processes(strategy: Any) -> list[Any]:
    """The processes the strategy's popen launcher started (empty for other launchers, and off rank 0)."""
    return list(getattr(strategy._launcher, "procs", None) or [])


def default_backend(namespace: Namespace, device: torch.device) -> str:
    """The process-group backend Lightning picks for ``device``."""
    distributed = namespace.fabric_module("utilities.distributed")
    return str(distributed._get_default_process_group_backend_for_device(device))


def init_process_group(namespace: Namespace, environment: Any, backend: str, timeout: Any) -> None:
    """Start the default process group as Lightning's DDP does; a gloo group is also torn down at exit
    (Lightning registers that for NCCL only; an undestroyed gloo group sometimes aborts the process)."""
    distributed = namespace.fabric_module("utilities.distributed")
    distributed._init_dist_connection(environment, backend, timeout=timeout)
    if backend != "nccl":
        atexit.unregister(distributed._destroy_dist_connection)
        atexit.register(distributed._destroy_dist_connection)  # once, however many fits


def sync_ddp(namespace: Namespace, tensor: torch.Tensor, group: Any, reduce_op: Any) -> Any:
    """fabric's all-reduce of ``tensor`` (a no-op without a process group)."""
    return namespace.fabric_module("utilities.distributed")._sync_ddp_if_available(tensor, group,
                                                                                   reduce_op=reduce_op)


def set_rank_zero_rank(rank: int) -> None:
    """The rank ``rank_zero_only`` (one object, shared by both namespaces' ``rank_zero_*`` helpers) compares."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]


def wrap_process_observers(wrap: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """Replace ``_terminate_all`` of fabric's process-observer threads (found by their thread name) by
    ``wrap(original)``, once per thread. A patch: the observer has no hook, and it kills all processes
    before rank 0 can name the stage that failed."""
    for thread in threading.enumerate():
        terminate = getattr(thread, "_terminate_all", None)
        if thread.name != "child-process-observer" or terminate is None or getattr(thread, "_naspipe_delayed", False):
            continue
        thread._terminate_all = wrap(terminate)  # type: ignore[attr-defined]
        thread._naspipe_delayed = True  # type: ignore[attr-defined]


# -- the setup guard -------------------------------------------------------------------------------


def _method(owner: Any, name: str, *params: str) -> bool:
    """``owner.name`` is callable and its first parameters after ``self`` are ``params``."""
    method = getattr(owner, name, None)
    if not callable(method):
        return False
    try:
        names = [p for p in inspect.signature(method).parameters if p != "self"]
    except (TypeError, ValueError):
        return not params
    return names[:len(params)] == list(params)


def _sets(cls: Any, *names: str) -> bool:
    """``cls.__init__`` assigns attributes by these names (read from its code, without an instance)."""
    init = getattr(cls, "__init__", None)
    code = getattr(inspect.unwrap(init), "__code__", None) if init is not None else None
    return code is not None and set(names) <= set(code.co_names)


def _internals(ns: Namespace) -> dict[str, Callable[[], bool]]:
    """Each private API (as docs/design.md's table names it) -> whether ``ns`` has it in the shape NASPipe uses."""
    pl, fabric = ns.pytorch_module, ns.fabric_module
    loops, connectors = pl("loops.training_epoch_loop"), pl("trainer.connectors")
    epoch_loop = loops._TrainingEpochLoop
    distributed = fabric("utilities.distributed")
    subprocess_script = fabric("strategies.launchers.subprocess_script")
    return {
        "_TrainingEpochLoop._batches_that_stepped": lambda: _sets(epoch_loop, LOGGER_STEP_KEY),
        "_TrainingEpochLoop._should_check_val_epoch": lambda: _method(epoch_loop, "_should_check_val_epoch"),
        "_TrainingEpochLoop._broadcast_sigterm_tensor": lambda: _method(epoch_loop, "_broadcast_sigterm_tensor"),
        "_TrainingEpochLoop._results": lambda: _sets(epoch_loop, "_results"),
        "Trainer._results": lambda: isinstance(inspect.getattr_static(ns.pytorch.Trainer, "_results", None), property),
        "Trainer._logger_connector": lambda: _sets(ns.pytorch.Trainer, "_logger_connector"),
        "_LoggerConnector._current_fx": lambda: _sets(connectors.logger_connector.logger_connector._LoggerConnector,
                                                       "_current_fx"),
        "_LoggerConnector.update_train_step_metrics": lambda: _method(
            connectors.logger_connector.logger_connector._LoggerConnector, "update_train_step_metrics"),
        "_ResultCollection.update_metrics": lambda: _method(
            pl("trainer.connectors.logger_connector.result")._ResultCollection, "update_metrics", "key", "value",
            "batch_size"),
        "LightningModule._current_fx_name": lambda: _sets(ns.pytorch.LightningModule, "_current_fx_name"),
        "LightningModule._trainer": lambda: _sets(ns.pytorch.LightningModule, "_trainer"),
        "LightningModule._device": lambda: _sets(ns.fabric_module("utilities.device_dtype_mixin")
                                                 ._DeviceDtypeModuleMixin, "_device"),
        "LearningRateMonitor._extract_stats": lambda: _method(ns.pytorch.callbacks.LearningRateMonitor,
                                                              "_extract_stats", "trainer", "interval"),
        "ModelCheckpoint._every_n_train_steps": lambda: ns.pytorch.callbacks.ModelCheckpoint(
            every_n_train_steps=3)._every_n_train_steps == 3,
        "Trainer._signal_connector": lambda: _sets(ns.pytorch.Trainer, "_signal_connector"),
        "_SignalConnector._sigterm_notifier_fn": lambda: _method(connectors.signal_connector._SignalConnector,
                                                                 "_sigterm_notifier_fn", "signum", "_"),
        "_SignalConnector._slurm_sigusr_handler_fn": lambda: _method(connectors.signal_connector._SignalConnector,
                                                                     "_slurm_sigusr_handler_fn", "signum", "_"),
        "Trainer._accelerator_connector": lambda: _sets(ns.pytorch.Trainer, "_accelerator_connector"),
        "launchers._SubprocessScriptLauncher": lambda: hasattr(pl("strategies.launchers"), "_SubprocessScriptLauncher"),
        "launchers._MultiProcessingLauncher": lambda: hasattr(pl("strategies.launchers"), "_MultiProcessingLauncher"),
        "Strategy._configure_launcher": lambda: _method(ns.parallel_strategy, "_configure_launcher"),
        "Strategy._launcher, _accelerator, _precision_plugin, _checkpoint_io": lambda: _sets(
            ns.pytorch.strategies.Strategy, "_launcher", "_accelerator", "_precision_plugin", "_checkpoint_io"),
        "_ChildProcessObserver._terminate_all": lambda: _method(subprocess_script._ChildProcessObserver,
                                                                "_terminate_all"),
        "_init_dist_connection": lambda: _method(distributed, "_init_dist_connection", "cluster_environment",
                                                 "torch_distributed_backend"),
        "_destroy_dist_connection": lambda: _method(distributed, "_destroy_dist_connection"),
        "_sync_ddp_if_available": lambda: _method(distributed, "_sync_ddp_if_available", "result", "group",
                                                  "reduce_op"),
        "_get_default_process_group_backend_for_device": lambda: _method(
            distributed, "_get_default_process_group_backend_for_device", "device"),
        "rank_zero_only.rank": lambda: isinstance(getattr(rank_zero_only, "rank", None), int),
        "_WrappingCheckpointIO": lambda: hasattr(pl("plugins.io.wrapper"), "_WrappingCheckpointIO"),
        "Precision._clip_gradients": lambda: _method(ns.pytorch.plugins.precision.Precision, "_clip_gradients",
                                                     "model", "optimizer", "clip_val", "gradient_clip_algorithm"),
        "LightningOptimizer._optimizer": lambda: _sets(pl("core.optimizer").LightningOptimizer, "_optimizer"),
        "CSVLogger/TensorBoardLogger._version, _experiment": lambda: all(
            _sets(getattr(fabric("loggers"), name), "_version", "_experiment")
            for name in ("CSVLogger", "TensorBoardLogger")),
    }


def check_internals(namespace: Namespace) -> list[str]:
    """The private Lightning APIs NASPipe needs that ``namespace`` lacks or has in another shape (empty: none).

    Cheap (no Trainer is built): classes, signatures and the attributes their ``__init__`` sets.
    """
    missing = []
    for name, present in _internals(namespace).items():
        try:
            ok = present()
        except (AttributeError, ImportError, TypeError):
            ok = False
        if not ok:
            missing.append(name)
    return missing


def require_internals(namespace: Namespace) -> None:
    """Raise :class:`NASPipeConfigError` naming what :func:`check_internals` finds missing, the installed
    Lightning version and the supported range; nothing when all are there."""
    missing = check_internals(namespace)
    if missing:
        raise NASPipeConfigError(
            f"{namespace.name} {namespace.version} lacks private APIs NASPipe relies on for exact training: "
            f"{', '.join(missing)}. NASPipe supports {SUPPORTED}; install a version in that range."
        )

