"""One-way imports between lightning_naspipe's subpackages, checked by an AST walk over every module.

The layers, bottom up (each may import the ones below it and itself, never one above):

* base: ``errors``, ``namespaces`` (the top-level modules that everything may use);
* ``compat``: the one home of private Lightning, torch and Python names and of runtime patches (imports only the
  base). Every layer above the base may import ``compat.torch``, ``compat.python`` and ``compat.malloc``; only
  ``integration`` and the entry may import ``compat.lightning``, the one module outside ``integration`` that imports
  a Lightning namespace;
* ``space``: what users write (supernet, choices, cells, freezing);
* ``schedule``: the CSP schedule, pure Python (actions, schedules, rules, lookahead);
* ``transport``: between stage processes (wire, links, collectives), in a schedule's send order;
* ``pipeline``: training windows on a stage (runtime, exactness, placement, sampling, offload);
* ``planning`` (measuring and predicting) and ``searching`` (after training), side by side: neither
  imports the other, and nothing below them imports either;
* ``integration``: the Lightning glue, the only subpackage (with ``compat.lightning``) that imports a Lightning
  namespace (``lightning``, ``pytorch_lightning``, ``lightning_fabric``); it may import every layer;
* entry: the top-level ``__init__`` and ``__main__``, which may import anything and which nothing imports.

Every import counts: module level, inside functions and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lightning_naspipe"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

LIGHTNING_NAMESPACES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric"})
BASE_MODULES = frozenset({"errors", "namespaces"})
ENTRY_MODULES = frozenset({"__init__", "__main__"})
#: Layer -> the layers it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "compat": frozenset({"base"}),
    "space": frozenset({"base", "compat"}),
    "schedule": frozenset({"base", "compat", "space"}),
    "transport": frozenset({"base", "compat", "space", "schedule"}),
    "pipeline": frozenset({"base", "compat", "space", "schedule", "transport"}),
    "planning": frozenset({"base", "compat", "space", "schedule", "transport", "pipeline"}),
    "searching": frozenset({"base", "compat", "space", "schedule", "transport", "pipeline"}),
    "integration": frozenset({"base", "compat", "space", "schedule", "transport", "pipeline", "planning", "searching"}),
    "entry": frozenset({"base", "compat", "space", "schedule", "transport", "pipeline", "planning", "searching",
                        "integration", "entry"}),
}
#: The module of ``compat`` that reaches Lightning: it alone outside integration imports a Lightning namespace, and
#: only these layers import it.
COMPAT_LIGHTNING = f"{PACKAGE}.compat.lightning"
IMPORT_COMPAT_LIGHTNING = frozenset({"integration", "entry", "compat"})
#: What may sit at the package's top level besides the subpackages.
TOP_LEVEL_FILES = frozenset({"__init__.py", "__main__.py", "errors.py", "namespaces.py", "py.typed"})


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside the package."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "entry"
    head = parts[1]
    if head in BASE_MODULES:
        return "base"
    if head in ENTRY_MODULES:
        return "entry"
    if head not in ALLOWED or head in {"base", "entry"}:
        raise ValueError(f"{module}: not in any layer; put it in a subpackage (see tests/test_layers.py)")
    return head


def _imported(module: str, is_package: bool, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) for every import in the tree; ``from a import b`` gives ``a.b`` when
    ``a`` is this package or a subpackage of it (``b`` may be a module), else ``a``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == PACKAGE or (source.startswith(PACKAGE + ".") and _is_package(source)):
                found.extend((node.lineno, f"{source}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, source))
    return found


def _is_package(dotted: str) -> bool:
    return (ROOT.parent / Path(*dotted.split("."))).is_dir()


def _target_layer(name: str) -> str:
    """The layer of an imported package name: a top-level name of the package that is neither a
    module nor a subpackage (``from lightning_naspipe import Supernet``) is the entry's."""
    parts = name.split(".")
    if len(parts) >= 2 and not (ROOT / parts[1]).is_dir() and not (ROOT / f"{parts[1]}.py").exists():
        return "entry"
    return layer_of(".".join(parts[:2]))


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each import of ``source`` (the text of ``module``) that its layer may not make, as ``line: import (why)``."""
    layer = layer_of(module)
    tree = ast.parse(source)
    found: list[str] = []
    for line, name in _imported(module, is_package, tree):
        top = name.split(".")[0]
        if top in LIGHTNING_NAMESPACES and layer != "integration" and module != COMPAT_LIGHTNING:
            found.append(f"{line}: {name} (only integration and compat.lightning import a Lightning namespace; "
                         f"{layer} may not)")
        if (name == COMPAT_LIGHTNING or name.startswith(COMPAT_LIGHTNING + ".")) and (
                layer not in IMPORT_COMPAT_LIGHTNING):
            found.append(f"{line}: {name} (only integration and the entry import compat.lightning; {layer} may not)")
            continue
        if top != PACKAGE:
            continue
        target = _target_layer(name)
        if target == layer or target in ALLOWED[layer]:
            continue
        found.append(f"{line}: {name} ({layer} may not import {target})")
    return found


def _modules() -> list[tuple[Path, str, bool]]:
    modules = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__" and len(parts) > 2
        dotted = ".".join(parts[:-1] if is_package else parts)
        modules.append((path, dotted, is_package))
    return modules


def test_every_import_points_down() -> None:
    problems = []
    for path, module, is_package in _modules():
        for problem in violations(module, path.read_text(), is_package):
            problems.append(f"{path.relative_to(ROOT.parent)}:{problem}")
    assert not problems, "imports against the layering (tests/test_layers.py):\n" + "\n".join(problems)


def test_top_level_holds_only_the_base_the_entry_and_subpackages() -> None:
    loose = sorted(p.name for p in ROOT.iterdir()
                   if p.is_file() and p.name not in TOP_LEVEL_FILES and not p.name.endswith(".pyc"))
    assert not loose, f"modules at lightning_naspipe's top level belong in a subpackage: {loose}"
    subpackages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert subpackages == set(ALLOWED) - {"base", "entry"}, subpackages


def test_every_subpackage_states_its_role() -> None:
    for init in ROOT.rglob("__init__.py"):
        if init.parent == ROOT:
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init} has no docstring stating its role and what it may import"


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("lightning_naspipe.pipeline.runtime.engine", "import pytorch_lightning\n",
     "only integration and compat.lightning import a Lightning"),
    ("lightning_naspipe.pipeline.runtime.engine", "from lightning.pytorch import Trainer\n", "only integration"),
    ("lightning_naspipe.transport.p2p", "import lightning_fabric.utilities\n", "only integration"),
    ("lightning_naspipe.pipeline.runtime.engine",
     "from lightning_naspipe.integration.strategy import NASPipeStrategy\n",
     "pipeline may not import integration"),
    ("lightning_naspipe.transport.wire", "from lightning_naspipe.pipeline.runtime.engine import Engine\n",
     "transport may not import pipeline"),
    ("lightning_naspipe.transport.wire", "from lightning_naspipe.pipeline import engine\n",
     "transport may not import pipeline"),
    ("lightning_naspipe.pipeline.runtime.engine", "def f():\n    from lightning_naspipe.planning import plan\n",
     "pipeline may not import planning"),
    ("lightning_naspipe.space.supernet", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from lightning_naspipe.searching.searchers import Record\n", "space may not import searching"),
    ("lightning_naspipe.searching.search_loop", "from lightning_naspipe.planning.planner import plan\n",
     "searching may not import planning"),
    ("lightning_naspipe.errors", "from lightning_naspipe.space.choice import When\n", "base may not import space"),
    ("lightning_naspipe.schedule.schedules", "from lightning_naspipe.transport.p2p import P2PTransport\n",
     "schedule may not import transport"),
    ("lightning_naspipe.schedule.lookahead", "from lightning_naspipe.pipeline.exactness.ties import ties_of\n",
     "schedule may not import pipeline"),
    ("lightning_naspipe.space.boundary", "from lightning_naspipe.schedule.actions import Action\n",
     "space may not import schedule"),
    ("lightning_naspipe.pipeline.runtime.engine", "from lightning_naspipe import Supernet\n",
     "pipeline may not import entry"),
    ("lightning_naspipe.pipeline.runtime.engine",
     "from ... import integration\n", "pipeline may not import integration"),
    ("lightning_naspipe.pipeline.offload.offload", "from ...integration.strategy import NASPipeStrategy\n",
     "pipeline may not import integration"),
    ("lightning_naspipe.pipeline.exactness.clipping", "from lightning_naspipe.compat import lightning\n",
     "only integration and the entry import compat.lightning; pipeline may not"),
    ("lightning_naspipe.space.supernet", "from lightning_naspipe.compat.lightning import swap_class\n",
     "only integration and the entry import compat.lightning; space may not"),
    ("lightning_naspipe.pipeline.runtime.engine", "from ...compat import lightning\n",
     "compat.lightning; pipeline may not"),
    ("lightning_naspipe.compat.torch", "import lightning.pytorch\n", "only integration and compat.lightning"),
    ("lightning_naspipe.compat.python", "from lightning_naspipe.space.choice import When\n",
     "compat may not import space"),
    ("lightning_naspipe.errors", "from lightning_naspipe.compat.torch import pytree\n", "base may not import compat"),
])
def test_the_checker_catches_a_violation(module: str, source: str, expected: str) -> None:
    found = violations(module, source)
    assert len(found) == 1 and expected in found[0], found


def test_the_checker_lets_downward_imports_through() -> None:
    source = ("import torch\nimport lightning_utilities\n"
              "from lightning_naspipe.transport import wire\nfrom lightning_naspipe.errors import NASPipeConfigError\n"
              "from lightning_naspipe.space.supernet import Supernet\nfrom .schedule import Schedule\n")
    assert violations("lightning_naspipe.pipeline.runtime.engine", source) == []
    assert violations("lightning_naspipe.transport.p2p", "from lightning_naspipe.schedule.actions import NORMS\n") == []
    assert violations("lightning_naspipe.integration.strategy", "import pytorch_lightning\n"
                      "from lightning_naspipe.planning.block_timing import agreed_timed_weights\n") == []
    # compat: torch's and Python's for every layer; Lightning's for integration and the entry
    for module in ("lightning_naspipe.space.choice", "lightning_naspipe.transport.wire",
                   "lightning_naspipe.pipeline.runtime.engine", "lightning_naspipe.searching.export",
                   "lightning_naspipe.integration.loss_log"):
        assert violations(module, "from lightning_naspipe.compat.torch import pytree\n"
                                  "from lightning_naspipe.compat import python\n") == [], module
    assert violations("lightning_naspipe.integration.loss_log",
                      "from lightning_naspipe.compat import lightning\n") == []
    assert violations("lightning_naspipe", "from lightning_naspipe.compat.lightning import SUPPORTED\n") == []
    assert violations("lightning_naspipe.compat.lightning", "import lightning_fabric\n"
                      "from lightning_naspipe.namespaces import Namespace\n") == []


def test_a_stray_top_level_module_has_no_layer() -> None:
    with pytest.raises(ValueError, match="not in any layer"):
        layer_of("lightning_naspipe.engine")
