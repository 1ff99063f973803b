from __future__ import annotations

import importlib.util

import lightning_naspipe as lnp
from lightning_naspipe.searching import searchers
from lightning_naspipe.transport import p2p as transport


def test_every_public_name_resolves_and_those_users_signatures_need_are_there() -> None:
    assert all(getattr(lnp, name, None) is not None for name in lnp.__all__)
    assert {"Architecture", "Record", "Searcher", "StageFailure", "__version__"} <= set(lnp.__all__)
    assert lnp.Record is searchers.Record and lnp.StageFailure is transport.StageFailure  # one home each


def test_the_re_export_modules_of_never_released_names_are_gone() -> None:
    for name in ("planner", "profile", "space_spec"):
        assert importlib.util.find_spec(f"lightning_naspipe.{name}") is None
        assert importlib.util.find_spec(f"lightning_naspipe.planning.{name}") is not None


def test_every_module_exports_only_names_it_defines() -> None:
    # One name, one home: a module's __all__ lists what it defines, never what it imports (package
    # __init__ files are the exception: they state a subpackage's or the package's API).
    import ast
    from pathlib import Path

    root = Path(lnp.__file__).parent
    re_exported = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)}
        defined |= {node.target.id for node in tree.body
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                assert isinstance(node.value, (ast.List, ast.Tuple))
                names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                re_exported += [f"{path.relative_to(root)}: {name}" for name in names if name not in defined]
    assert not re_exported, re_exported


def test_the_version_is_the_released_one_in_pyproject() -> None:
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # no tomllib before Python 3.11
    assert re.findall(r'^version = "([^"]+)"', pyproject, re.M) == [lnp.__version__]
