"""Guards for every private Lightning and torch API the package uses, one test per row of docs/design.md's
"Private Lightning and torch APIs, all of them" table, and a check that the table lists them all.

Each guard fails loudly when the installed Lightning or torch drops the private API or changes its shape
(names, parameters, what it holds), so an upgrade breaks here, naming the API, rather than deep inside a
run. Lightning guards run under both namespaces (``lightning.pytorch`` and ``pytorch_lightning``), as
the package does (``lightning_naspipe.namespaces``).

:func:`test_the_table_lists_every_private_api_the_package_uses` walks every module's AST and collects
the private names it reaches on objects that are not its own: ``x._name``, ``getattr(x, "_name")`` and
``x["_name"]``, imports of ``_``-prefixed modules and names, and ``self._name`` / ``def _name`` in a class whose
Lightning or torch base defines ``_name``. They must all be in ``lightning_naspipe/compat/`` (the one home of
internals), and those names and the table's first column must be equal.
:func:`test_runtime_patches_live_in_compat` finds monkey-patching (``x.__class__ = ...``, ``setattr`` on or
assignment to a foreign module's attribute) outside ``compat/``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe
from lightning_naspipe.namespaces import Namespace, installed

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "lightning_naspipe"
DESIGN = ROOT / "docs" / "design.md"
SECTION = "## Private Lightning and torch APIs, all of them"
#: Private-looking names the scan finds that are no Lightning or torch API, with the reason.
NOT_LIGHTNING_OR_TORCH = {"_exit": "os._exit, a documented standard-library function"}

NAMESPACES = [pytest.param(ns, id=ns.name) for ns in installed()]
#: The one home of private names and runtime patches.
COMPAT = "lightning_naspipe/compat/"
#: Top-level modules whose attributes the package must not assign outside compat/ (monkey-patching).
FOREIGN = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "numpy", "random")


def _trainer(ns: Namespace) -> Any:
    return ns.pytorch.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)


def _has_method(obj: Any, name: str, *params: str) -> None:
    """``obj.name`` is callable and takes ``params`` (by these names, in this order, after ``self``)."""
    method = getattr(obj, name, None)
    assert callable(method), f"{obj!r} has no method {name}: a private API NASPipe uses is gone"
    if params:
        names = [p for p in inspect.signature(method).parameters if p != "self"]
        assert names[:len(params)] == list(params), f"{name}{inspect.signature(method)}: expected {params}"


# -- the fit loop and its checkpoint state ----------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_fit_loop_checkpoint_layout(ns: Namespace) -> None:
    from lightning_naspipe.integration.loop_state import check_loop_state_layout

    trainer = _trainer(ns)
    state = trainer.fit_loop.state_dict()
    check_loop_state_layout({"loops": {"fit_loop": state}, "pytorch-lightning_version": ns.version})
    assert "_batches_that_stepped" in state["epoch_loop.state_dict"]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_epoch_loop_should_check_val_epoch(ns: Namespace) -> None:
    epoch_loop = _trainer(ns).fit_loop.epoch_loop
    _has_method(epoch_loop, "_should_check_val_epoch")
    assert not inspect.signature(epoch_loop._should_check_val_epoch).parameters
    assert isinstance(epoch_loop._should_check_val_epoch(), bool)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_epoch_loop_batches_that_stepped(ns: Namespace) -> None:
    epoch_loop = _trainer(ns).fit_loop.epoch_loop
    assert epoch_loop._batches_that_stepped == 0
    epoch_loop._batches_that_stepped = 7  # the loggers' step axis
    assert _trainer(ns).fit_loop.epoch_loop._batches_that_stepped == 0
    assert epoch_loop.state_dict()["state_dict"]["_batches_that_stepped"] == 7
    # the step the logger connector gives the loggers
    connector_module = importlib.import_module(type(_trainer(ns)._logger_connector).__module__)
    assert "fit_loop.epoch_loop._batches_that_stepped" in inspect.getsource(connector_module)


# -- logging ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_trainer_results(ns: Namespace) -> None:
    trainer = _trainer(ns)
    assert isinstance(inspect.getattr_static(type(trainer), "_results"), property)
    results = trainer.fit_loop.epoch_loop._results
    _has_method(results, "update_metrics", "key", "value", "batch_size")
    results.batch, results.batch_size = [torch.zeros(2)], None  # plain attributes: the batch self.log sizes
    metric_source = inspect.getsource(importlib.import_module(type(results).__module__)._ResultMetric)
    for attribute in ("self.value", "self.cumulated_batch_size", "self.meta"):  # what a resumed epoch sum sets
        assert attribute in metric_source, f"_ResultMetric has no {attribute}"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_logger_connector(ns: Namespace) -> None:
    connector = _trainer(ns)._logger_connector
    _has_method(connector, "on_batch_start", "batch")
    _has_method(connector, "update_train_step_metrics")
    _has_method(connector, "should_reset_tensors", "fx")
    assert isinstance(inspect.getattr_static(type(connector), "should_update_logs"), property)
    assert "_current_fx" in vars(connector)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_module_current_fx_name(ns: Namespace) -> None:
    module = ns.pytorch.LightningModule()
    assert "_current_fx_name" in vars(module) and module._current_fx_name is None
    assert "self._current_fx_name" in inspect.getsource(type(module).log)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_lr_monitor_extract_stats(ns: Namespace) -> None:
    _has_method(ns.pytorch.callbacks.LearningRateMonitor, "_extract_stats", "trainer", "interval")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_manual_optimization_drops_scheduler_monitor(ns: Namespace) -> None:
    # Not called by NASPipe: the behaviour callback.keep_scheduler_monitors works around.
    configure = ns.pytorch_module("core.optimizer")._configure_schedulers_manual_opt
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.warns(Warning, match="monitor"):
        (config,) = configure([{"scheduler": scheduler, "monitor": "val_loss"}])
    assert config.monitor is None, "Lightning keeps `monitor` now: keep_scheduler_monitors may go"


# -- processes, launchers and the process group -----------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_launchers(ns: Namespace) -> None:
    launchers = ns.pytorch_module("strategies.launchers")
    environment = ns.fabric.plugins.environments.LightningEnvironment()
    launcher = launchers._SubprocessScriptLauncher(environment, 2, 1)
    assert list(launcher.procs) == []  # filled with the Popen objects of the stage processes it starts
    params = list(inspect.signature(launchers._MultiProcessingLauncher).parameters)
    assert params[:2] == ["strategy", "start_method"], params
    _has_method(ns.parallel_strategy, "_configure_launcher")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_process_observer(ns: Namespace) -> None:
    observer_class = ns.fabric_module("strategies.launchers.subprocess_script")._ChildProcessObserver
    observer = observer_class(main_pid=0, child_processes=[])
    assert isinstance(observer, threading.Thread) and observer.name == "child-process-observer"
    _has_method(observer, "_terminate_all")
    assert "self._terminate_all()" in inspect.getsource(observer_class)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_fabric_distributed_helpers(ns: Namespace) -> None:
    distributed = ns.fabric_module("utilities.distributed")
    _has_method(distributed, "_init_dist_connection", "cluster_environment", "torch_distributed_backend")
    parameters = inspect.signature(distributed._init_dist_connection).parameters.values()
    assert any(p.kind is p.VAR_KEYWORD for p in parameters)  # NASPipe passes timeout=
    _has_method(distributed, "_destroy_dist_connection")
    _has_method(distributed, "_sync_ddp_if_available", "result", "group", "reduce_op")
    _has_method(distributed, "_get_default_process_group_backend_for_device", "device")
    assert distributed._get_default_process_group_backend_for_device(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_rank_zero_only_rank(ns: Namespace) -> None:
    from lightning_utilities.core.rank_zero import rank_zero_only

    # One function object serves both namespaces' rank_zero_* helpers, so setting its rank once suffices.
    assert ns.pytorch_module("utilities.rank_zero").rank_zero_only is rank_zero_only
    assert ns.fabric_module("utilities.rank_zero").rank_zero_only is rank_zero_only
    assert isinstance(rank_zero_only.rank, int)  # type: ignore[attr-defined]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_signal_connector(ns: Namespace) -> None:
    trainer = _trainer(ns)
    connector = trainer._signal_connector
    _has_method(connector, "_sigterm_notifier_fn", "signum", "_")
    _has_method(connector, "_slurm_sigusr_handler_fn", "signum", "_")
    assert connector.received_sigterm is False
    assert trainer._accelerator_connector.cluster_environment is not None
    _has_method(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(type(trainer.fit_loop.epoch_loop))


def test_default_store() -> None:
    getter = torch.distributed.distributed_c10d._get_default_store
    assert callable(getter) and not inspect.signature(getter).parameters


# -- the strategy's plugins and checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_model_checkpoint_every_n_train_steps(ns: Namespace) -> None:
    assert ns.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=3)._every_n_train_steps == 3
    assert ns.pytorch.callbacks.ModelCheckpoint()._every_n_train_steps == 0


@pytest.mark.parametrize("ns", NAMESPACES)
def test_wrapping_checkpoint_io(ns: Namespace) -> None:
    wrapping = ns.pytorch_module("plugins.io.wrapper")._WrappingCheckpointIO
    assert issubclass(ns.pytorch.plugins.AsyncCheckpointIO, wrapping)
    assert isinstance(inspect.getattr_static(wrapping, "checkpoint_io"), property)
    assert ns.pytorch.plugins.AsyncCheckpointIO().checkpoint_io is None  # no inner IO yet


@pytest.mark.parametrize("ns", NAMESPACES)
def test_module_trainer(ns: Namespace) -> None:
    module = ns.pytorch.LightningModule()
    assert "_trainer" in vars(module) and module._trainer is None


@pytest.mark.parametrize("ns", NAMESPACES)
def test_strategy_plugin_attributes(ns: Namespace) -> None:
    io = ns.fabric.plugins.TorchCheckpointIO()
    strategy = ns.pytorch.strategies.DDPStrategy(checkpoint_io=io)
    assert {"_accelerator", "_precision_plugin", "_checkpoint_io", "_launcher"} <= set(vars(strategy))
    assert strategy._checkpoint_io is io and strategy.checkpoint_io is io
    accelerator = ns.pytorch.accelerators.CPUAccelerator()
    strategy._accelerator = accelerator
    assert strategy.accelerator is accelerator


@pytest.mark.parametrize("ns", NAMESPACES)
def test_precision_clip_gradients(ns: Namespace) -> None:
    precision = ns.pytorch.plugins.precision.Precision
    _has_method(precision, "_clip_gradients", "model", "optimizer", "clip_val", "gradient_clip_algorithm")
    assert "self._clip_gradients(" in inspect.getsource(precision._after_closure)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_lightning_optimizer_optimizer(ns: Namespace) -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert ns.pytorch_module("core.optimizer").LightningOptimizer(optimizer)._optimizer is optimizer


@pytest.mark.parametrize("ns", NAMESPACES)
def test_module_device(ns: Namespace) -> None:
    module = ns.pytorch.LightningModule()
    assert module._device == torch.device("cpu")
    module._device = torch.device("meta")
    assert module.device == torch.device("meta")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_logger_version_and_experiment(ns: Namespace, tmp_path: Path) -> None:
    loggers = ns.fabric_module("loggers")
    logger = loggers.CSVLogger(tmp_path, version="fixed")
    assert logger._version == "fixed" and logger._experiment is None
    logger._version = "fixed/search"
    assert logger.version == "fixed/search"
    source = inspect.getsource(loggers.TensorBoardLogger)  # tensorboard itself may be missing here
    assert "self._version = version" in source and "self._experiment" in source


# -- torch ------------------------------------------------------------------------------------------


def test_foreach_utils() -> None:
    from torch.utils._foreach_utils import (_device_has_foreach_support, _group_tensors_by_device_and_dtype,
                                            _has_foreach_support)

    grads = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(1)]
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    ((tensors,), indices) = grouped[(torch.device("cpu"), torch.float32)]
    assert indices == [0, 2] and len(grouped) == 2
    assert isinstance(_has_foreach_support(tensors, torch.device("cpu")), bool)
    assert isinstance(_device_has_foreach_support(torch.device("cpu")), bool)
    norms = torch._foreach_norm(tensors, 2.0)
    assert torch.equal(torch.stack(norms), torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def test_pytree() -> None:
    import torch.utils._pytree as pytree

    value = {"x": (torch.zeros(1), 3, None), "y": [torch.ones(2)]}
    leaves, spec = pytree.tree_flatten(value)
    assert len(leaves) == 4 and pytree.tree_leaves(value)[0] is leaves[0]
    again = pytree.tree_unflatten(leaves, pickle.loads(pickle.dumps(spec)))  # the wire pickles the spec
    assert again["x"][1] == 3 and again["y"][0] is leaves[-1]
    assert pytree.tree_map(lambda leaf: leaf, value)["x"][0] is leaves[0]


def test_tensor_version_counter() -> None:
    buffer = torch.zeros(2)
    before = buffer._version
    buffer += 1
    assert buffer._version > before
    buffer.detach()  # reading or detaching changes nothing
    assert buffer._version == before + 1


def test_module_buffers_and_modules() -> None:
    norm = nn.BatchNorm1d(2)
    assert list(norm._buffers) == ["running_mean", "running_var", "num_batches_tracked"]
    norm._buffers["running_mean"] = torch.ones(2)  # how offload swaps a buffer's tensor
    assert torch.equal(norm.running_mean, torch.ones(2))
    sequential = nn.Sequential(nn.Linear(1, 1))
    sequential._modules["0"] = nn.Identity()  # how freezing replaces a choice by its candidate
    assert isinstance(sequential[0], nn.Identity)


def test_batchnorm_base() -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    for norm in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm2d):
        assert issubclass(norm, _BatchNorm)


# -- Python and NumPy --------------------------------------------------------------------------------


def test_host_generator_internals() -> None:
    import _random
    import random

    import numpy as np

    from lightning_naspipe.compat import python as compat_python
    from lightning_naspipe.pipeline.sampling import host_rng

    assert isinstance(random._inst, _random.Random), "random._inst is no longer the module's generator"
    assert compat_python.RAW_PYTHON_STATE, "CPython's Random no longer keeps its state where host_rng copies it from"
    bit_generator = np.random.mtrand._rand._bit_generator
    assert isinstance(bit_generator, np.random.MT19937), "NumPy's global generator is no longer an MT19937"
    address = int(bit_generator.ctypes.state_address)
    # the raw bytes host_rng saves are the whole state: restoring them repeats the draws
    saved = host_rng.seed_host_generators(7)
    first = (random.random(), float(np.random.rand()))
    host_rng.restore_host_generators(saved)
    again = host_rng.seed_host_generators(7)
    assert again[2] == address
    assert (random.random(), float(np.random.rand())) == first
    host_rng.restore_host_generators(again)


# -- the table lists them all -----------------------------------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and not name.startswith("_naspipe")


def _modules() -> Iterator[tuple[Path, ast.Module, ModuleType | None]]:
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name) if parts[-1] != "__main__" else None
        yield path, ast.parse(path.read_text(), str(path)), module


def _foreign_private_names(cls: type) -> set[str]:
    """Private names that the non-package classes in ``cls``'s MRO define or set on ``self``."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("lightning_naspipe", "builtins", "typing", "abc"):
            continue
        names |= {n for n in [*vars(base), *getattr(base, "__annotations__", {})] if _is_private(n)}
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        names |= {n for n in re.findall(r"self\.(_\w+)\s*(?::[^=\n]*)?=[^=]", source) if _is_private(n)}
    return names


def _runtime_class(module: ModuleType, node: ast.ClassDef) -> type | None:
    """The class as it runs: the package's mixins are scanned mixed into the Lightning class they serve."""
    cls = getattr(module, node.name, None)
    if not isinstance(cls, type):
        return None
    ns = installed()[0]
    bound = getattr(importlib.import_module("lightning_naspipe.integration.strategy"),
                    {"lightning.pytorch": "LightningNASPipeStrategy"}.get(ns.name, "PytorchLightningNASPipeStrategy"))
    if cls in bound.__mro__:
        return bound  # type: ignore[no-any-return]
    mixed_into = {"NASPipeMixin": ns.pytorch.LightningModule, "SubnetProgress": ns.pytorch.callbacks.ProgressBar}
    if node.name in mixed_into:
        return type(node.name, (cls, mixed_into[node.name]), {})
    return cls


def private_uses() -> dict[str, set[str]]:
    """Each private Lightning or torch name the package reaches -> where (``path:line``)."""
    trees = list(_modules())
    own: set[str] = set()  # private names the package defines itself (a collision is listed in the table)
    for _, tree, _ in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
    documented = documented_names()
    found: dict[str, set[str]] = {}

    def add(name: str, path: Path, node: ast.AST) -> None:
        found.setdefault(name, set()).add(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}")

    for path, tree, module in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    for part in alias.name.split("."):
                        if _is_private(part):
                            add(part, path, node)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] == "lightning_naspipe":
                    continue
                for part in node.module.split(".") + [alias.name for alias in node.names]:
                    if _is_private(part):
                        add(part, path, node)
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not on_self and (node.attr not in own or node.attr in documented):
                    add(node.attr, path, node)
            elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                  and isinstance(node.slice.value, str) and node.slice.value.isidentifier()
                  and _is_private(node.slice.value)):
                add(node.slice.value, path, node)  # a key of Lightning's own state, e.g. the checkpoint's loops
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _is_private(node.args[1].value)):
                name = node.args[1].value
                if name not in own or name in documented:
                    add(name, path, node)
            elif isinstance(node, ast.ClassDef) and module is not None:
                cls = _runtime_class(module, node)
                foreign = _foreign_private_names(cls) if cls is not None else set()
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in ("self", "cls") and sub.attr in foreign):
                        add(sub.attr, path, sub)
                    elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name in foreign:
                        add(sub.name, path, sub)  # overrides a private method
    for name in NOT_LIGHTNING_OR_TORCH:
        found.pop(name, None)
    return found


def table_rows() -> list[list[str]]:
    text = DESIGN.read_text()
    assert SECTION in text, f"docs/design.md lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows and rows[0].startswith("| private names |"), "the table's first column must be 'private names'"
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


def documented_names() -> set[str]:
    names: set[str] = set()
    for row in table_rows():
        for code in re.findall(r"`([^`]+)`", row[0]):
            names |= {part for part in re.findall(r"\w+", code) if _is_private(part)}
    return names


def outside_compat(used: dict[str, set[str]]) -> dict[str, list[str]]:
    """Of ``used`` (:func:`private_uses`), the places outside compat/, by name."""
    outside = {name: sorted(w for w in where if not w.startswith(COMPAT)) for name, where in used.items()}
    return {name: where for name, where in outside.items() if where}


def test_the_table_lists_every_private_api_the_package_uses() -> None:
    used, documented = private_uses(), documented_names()
    outside = outside_compat(used)
    assert not outside, (f"private Lightning/torch names reached outside {COMPAT} (call an accessor of "
                         f"lightning_naspipe.compat instead): {outside}")
    missing = {name: sorted(where) for name, where in used.items() if name not in documented}
    assert not missing, (f"private Lightning/torch names used but not in docs/design.md's table {SECTION!r}: "
                         f"{missing}; add a row (or the name to a row) with a guard test in this file")
    stale = documented - set(used)
    assert not stale, f"docs/design.md's private API table lists names the package no longer uses: {sorted(stale)}"


def test_every_row_names_a_guard_test_here() -> None:
    here = {name for name in globals() if name.startswith("test_")}
    for row in table_rows():
        guards = re.findall(r"test_private_apis\.py::(test_\w+)", row[-1])
        assert guards, f"row {row[0]!r} names no guard test in tests/test_private_apis.py"
        unknown = set(guards) - here
        assert not unknown, f"row {row[0]!r} names guard tests that do not exist: {sorted(unknown)}"


def test_scan_finds_a_private_access() -> None:
    # the scan itself: the names it must find today, one of each kind of access
    used = private_uses()
    for name in ("_results", "_pytree", "_group_tensors_by_device_and_dtype", "_get_default_store", "_launcher",
                 "_configure_launcher", "_trainer"):
        assert name in used, name
    assert lightning_naspipe.__name__ == "lightning_naspipe"


def runtime_patches(path: str, source: str) -> list[str]:
    """``path:line`` of each monkey-patch in ``source``: ``x.__class__ = ...``, ``setattr(m, ...)`` or
    ``m.attr = ...`` where ``m`` is a foreign module (:data:`FOREIGN`, by its import name or alias)."""
    tree = ast.parse(source)
    aliases = set(FOREIGN)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] in FOREIGN}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in FOREIGN:
            aliases |= {a.asname or a.name for a in node.names if (a.asname or a.name)[:1].islower()}

    def foreign(node: ast.AST) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in aliases

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for leaf in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(leaf, ast.Attribute) and (leaf.attr == "__class__" or foreign(leaf.value)):
                    found.append(f"{path}:{leaf.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and foreign(node.args[0])):
            found.append(f"{path}:{node.lineno}")
    return found


def test_runtime_patches_live_in_compat() -> None:
    patches = [p for path in sorted(PACKAGE_DIR.rglob("*.py")) if not str(path.relative_to(ROOT)).startswith(COMPAT)
               for p in runtime_patches(str(path.relative_to(ROOT)), path.read_text())]
    assert not patches, f"runtime patches outside {COMPAT} (move the mechanics into a compat function): {patches}"
    inside = [p for path in sorted((PACKAGE_DIR / "compat").glob("*.py"))
              for p in runtime_patches(str(path.relative_to(ROOT)), path.read_text())]
    assert inside, "the scan finds the patches compat/ holds (swap_class, clip_grad_norm_)"


@pytest.mark.parametrize(("source", "count"), [
    ("bar.__class__ = Other\n", 1),
    ("import torch\ntorch.nn.utils.clip_grad_norm_ = f\n", 1),
    ("import torch.nn.utils as u\nsetattr(u, 'clip_grad_norm_', f)\n", 1),
    ("from lightning.pytorch import loops\nloops.x = 1\n", 1),
    ("import torch\nmodule.weight = torch.nn.Parameter(w)\nsetattr(module, 'w', p)\nself.x = 1\n", 0),
])
def test_the_patch_scan_finds_monkey_patching(source: str, count: int) -> None:
    assert len(runtime_patches("m.py", source)) == count, runtime_patches("m.py", source)


def test_the_scan_flags_a_private_name_outside_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    real = list(_modules())
    fake = (PACKAGE_DIR / "integration" / "fake.py", ast.parse("def f(trainer):\n    return trainer._results\n"), None)
    monkeypatch.setitem(globals(), "_modules", lambda: iter([*real, fake]))
    assert outside_compat(private_uses()) == {"_results": ["lightning_naspipe/integration/fake.py:2"]}
