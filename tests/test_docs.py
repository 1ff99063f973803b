"""Docs that cannot drift: docs/design.md's module tables against the package tree, docs/api.md against the code.

docs/design.md has one table per (sub)package under "## Modules", headed ``### `<dir>/`: ...`` and listing each
module as ``| `name.py` | what it does |``; a subpackage's ``__init__.py`` is described by its heading, not
listed. The tables and the tree must match exactly.

docs/api.md is checked against ``inspect.signature`` and the command-line parser:

* its index table lists exactly ``lnp.__all__``;
* every code span that reads as a signature, ``lnp.Name(params) -> type`` or
  ``lightning_naspipe.module.name(params) -> type`` (in a fenced block or inline), matches the object's parameters:
  names, kinds (positional, ``*args``, keyword-only, ``**kwargs``) and defaults (annotations are not compared,
  so type aliases may change freely); spans that do not parse as parameters (``lnp.RandomSearch(64)``,
  ``(...)``) are examples, not signatures;
* in a ``## `lnp.Class``` section, each bullet that starts with ``name(params)`` is a method of that class and
  is checked the same way, and every public method the package defines for the class must have one;
* every callable in ``lnp.__all__`` has a checked signature;
* ``NASPipeStrategy``'s argument table lists its parameters in order with their defaults;
* under "## Command line", each ``### `command``` subsection is one of ``python -m lightning_naspipe``'s
  subcommands (and each subcommand has one), and its option table lists exactly the subcommand's options with
  their defaults (a backticked default is the parser's; no backticks where the parser's default is None/False).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "lightning_naspipe"
DESIGN = ROOT / "docs" / "design.md"
API = ROOT / "docs" / "api.md"

# -- design.md's module tables ----------------------------------------------------------------------


def module_tables() -> dict[str, list[str]]:
    """Directory relative to the package (``""`` for the top) -> the modules its table lists."""
    text = DESIGN.read_text()
    modules_section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, list[str]] = {}
    for part in modules_section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        folder = re.search(r"`([\w/]+/)`", heading)
        assert folder, f"design.md module table heading names no folder: {heading!r}"
        key = folder.group(1).rstrip("/")
        key = "" if key == "lightning_naspipe" else key
        assert key not in tables, f"design.md has two module tables for {folder.group(1)}"
        tables[key] = [m.group(1) for line in body.splitlines()
                       if (m := re.match(r"\|\s*`([\w.]+\.py)`\s*\|", line))]
    return tables


def package_tree() -> dict[str, list[str]]:
    tree: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE_DIR).as_posix()
        folder = "" if folder == "." else folder
        if folder and path.name == "__init__.py":
            tree.setdefault(folder, [])
            continue
        tree.setdefault(folder, []).append(path.name)
    return tree


def test_design_module_tables_match_the_tree() -> None:
    tables, tree = module_tables(), package_tree()
    assert set(tables) == set(tree), (f"design.md's module tables are for {sorted(tables)}, the package has "
                                      f"{sorted(tree)}: one table per (sub)package")
    for folder, modules in tree.items():
        listed = tables[folder]
        assert len(listed) == len(set(listed)), f"{folder or 'lightning_naspipe'}/: a module listed twice"
        where = f"lightning_naspipe/{folder + '/' if folder else ''}"
        unlisted, gone = sorted(set(modules) - set(listed)), sorted(set(listed) - set(modules))
        assert not unlisted, f"design.md does not list {unlisted} in {where}"
        assert not gone, f"design.md lists {gone}, not in {where}"


# -- api.md against the code ------------------------------------------------------------------------

SIGNATURE = re.compile(r"^((?:lnp|lightning_naspipe)(?:\.\w+)+)\((.*)\)(?:\s*->\s*(.+))?$", re.S)
METHOD = re.compile(r"^(\w+)\((.*)\)(?:\s*->\s*(.+))?$", re.S)
#: What doc defaults may name.
DEFAULTS_NAMESPACE: dict[str, Any] = {"timedelta": timedelta, "torch": torch, "nn": nn, "lnp": lnp, "time": time}


def api_text() -> str:
    return API.read_text()


def sections() -> dict[str, str]:
    """``## `` title -> body."""
    parts = ("\n" + api_text()).split("\n## ")[1:]
    return {part.partition("\n")[0].strip(): part.partition("\n")[2] for part in parts}


def code_spans(text: str) -> list[str]:
    """Inline code spans (across line breaks) and the lines of fenced blocks."""
    spans: list[str] = []
    for index, chunk in enumerate(re.split(r"^```.*$", text, flags=re.M)):
        if index % 2:  # inside a fence
            spans += [line.strip() for line in chunk.splitlines() if line.strip()]
        else:
            spans += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", chunk)]
    return spans


def parse_params(params: str) -> ast.arguments | None:
    """``params`` as a def's parameters, or None when it does not read as parameters (an example call)."""
    try:
        function = ast.parse(f"def f({params}): pass").body[0]
    except SyntaxError:
        return None
    assert isinstance(function, ast.FunctionDef)
    return function.args


def documented(arguments: ast.arguments) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) of each documented parameter."""
    out: list[tuple[str, str, str | None]] = []
    positional = arguments.posonlyargs + arguments.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(arguments.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, None if default is None else ast.unparse(default)))
    if arguments.vararg:
        out.append((arguments.vararg.arg, "VAR_POSITIONAL", None))
    for arg, kw_default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", None if kw_default is None else ast.unparse(kw_default)))
    if arguments.kwarg:
        out.append((arguments.kwarg.arg, "VAR_KEYWORD", None))
    return out


def actual(obj: Any, drop_self: bool = False) -> list[tuple[str, str, Any]]:
    parameters = list(inspect.signature(obj).parameters.values())
    if drop_self and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return [(p.name, p.kind.name, p.default) for p in parameters]


def check_signature(where: str, arguments: ast.arguments, obj: Any, drop_self: bool = False) -> None:
    doc, code = documented(arguments), actual(obj, drop_self)
    assert [(n, k) for n, k, _ in doc] == [(n, k) for n, k, _ in code], (
        f"docs/api.md: {where} documents parameters {[(n, k) for n, k, _ in doc]}, the code has "
        f"{[(n, k) for n, k, _ in code]}")
    for (name, _, doc_default), (_, _, default) in zip(doc, code):
        if doc_default is None:
            assert default is inspect.Parameter.empty, f"docs/api.md: {where} omits {name}'s default {default!r}"
            continue
        assert default is not inspect.Parameter.empty, f"docs/api.md: {where} gives {name} a default; it has none"
        value = eval(doc_default, dict(DEFAULTS_NAMESPACE))  # noqa: S307 (our own docs)
        assert value == default, f"docs/api.md: {where}: {name}={doc_default}, the code's default is {default!r}"


def resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    if parts[0] == "lnp":
        obj: Any = lnp
        for part in parts[1:]:
            obj = getattr(obj, part)
        return obj
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError(f"docs/api.md names {dotted}, which does not import")


def checked_signatures() -> dict[str, list[str]]:
    """Check every signature span; return each documented dotted name -> where it was checked."""
    seen: dict[str, list[str]] = {}
    for span in code_spans(api_text()):
        match = SIGNATURE.match(span)
        if not match or (arguments := parse_params(match.group(2))) is None:
            continue
        target = resolve(match.group(1))
        check_signature(span[:60], arguments, target)
        seen.setdefault(match.group(1), []).append(span)
    return seen


def bullets(body: str) -> list[str]:
    """Each ``- `` item of a section, its continuation lines joined."""
    items: list[str] = []
    for line in body.splitlines():
        if line.startswith("- "):
            items.append(line[2:])
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        else:
            items.append("") if items and items[-1] else None
    return [item for item in items if item]


def class_sections() -> dict[str, str]:
    return {m.group(1): body for title, body in sections().items()
            if (m := re.fullmatch(r"`lnp\.(\w+)`", title)) and isinstance(getattr(lnp, m.group(1), None), type)}


def package_methods(cls: type) -> set[str]:
    """Public methods the package itself defines for ``cls`` (on it or a package base without a section)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_naspipe"):
            continue
        if klass is not cls and klass.__name__ in class_sections():
            continue  # documented in its own section (InputChoice's inherited ChoiceBlock methods)
        for name, value in vars(klass).items():
            if not name.startswith("_") and isinstance(value, (staticmethod, classmethod)) or (
                    not name.startswith("_") and inspect.isfunction(value)):
                names.add(name)
    return names


def test_the_index_lists_exactly_lnp_all() -> None:
    index = api_text().split("\n## ", 1)[0]
    listed = {name for line in index.splitlines() if line.startswith("|")
              for name in re.findall(r"`lnp\.(\w+)`", line.split("|")[1])}
    assert listed == set(lnp.__all__), (f"docs/api.md's index misses {sorted(set(lnp.__all__) - listed)} and "
                                        f"lists {sorted(listed - set(lnp.__all__))} not in lnp.__all__")


def test_documented_signatures_match_the_code() -> None:
    seen = checked_signatures()
    callables = [name for name in lnp.__all__ if callable(getattr(lnp, name))
                 and not (isinstance(getattr(lnp, name), type) and issubclass(getattr(lnp, name), BaseException))
                 and name not in ("Architecture", "Searcher")]  # a type alias and a protocol: no constructor
    missing = [name for name in callables if f"lnp.{name}" not in seen]
    assert not missing, f"docs/api.md shows no signature `lnp.Name(params)` for {missing}"


@pytest.mark.parametrize("name", sorted(class_sections()))
def test_documented_methods_match_the_code(name: str) -> None:
    cls = getattr(lnp, name)
    documented_methods = set()
    for item in bullets(class_sections()[name]):
        span = re.match(r"`([^`]+)`", item)
        match = METHOD.match(" ".join(span.group(1).split())) if span else None
        if not match or (arguments := parse_params(match.group(2))) is None:
            continue
        method = match.group(1)
        assert hasattr(cls, method), f"docs/api.md documents {name}.{method}, which does not exist"
        check_signature(f"{name}.{method}", arguments, getattr(cls, method), drop_self=True)
        documented_methods.add(method)
    undocumented = package_methods(cls) - documented_methods
    assert not undocumented, f"docs/api.md's `lnp.{name}` section does not document {sorted(undocumented)}"


def test_strategy_argument_table_matches_the_signature() -> None:
    body = class_sections()["NASPipeStrategy"]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in body.splitlines()
            if re.match(r"\|\s*`\w+`\s*\|", line)]
    doc = [(row[0].strip("`"), row[2].strip("`")) for row in rows]
    code = [(p.name, p.default) for p in inspect.signature(lnp.NASPipeStrategy).parameters.values()]
    assert [n for n, _ in doc] == [n for n, _ in code], "NASPipeStrategy's argument table is not its signature"
    for (name, doc_default), (_, default) in zip(doc, code):
        assert eval(doc_default, dict(DEFAULTS_NAMESPACE)) == default, f"NASPipeStrategy({name}=...): {doc_default}"


# -- the command line -------------------------------------------------------------------------------


class _Parsed(Exception):
    pass


def cli_parser() -> argparse.ArgumentParser:
    """The parser ``python -m lightning_naspipe`` builds (caught where it would parse)."""
    from lightning_naspipe.__main__ import main

    captured: list[argparse.ArgumentParser] = []

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured.append(self)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab), pytest.raises(_Parsed):
        main([])
    return captured[0]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in cli_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def cli_sections() -> dict[str, str]:
    body = next(b for title, b in sections().items() if title.startswith("Command line"))
    return {m.group(1): part.partition("\n")[2] for part in body.split("\n### ")[1:]
            if (m := re.match(r"`(\w+)`", part))}


def test_cli_subcommands_are_documented() -> None:
    assert set(cli_sections()) == set(subcommands()), (
        f"docs/api.md's command-line subsections are {sorted(cli_sections())}; python -m lightning_naspipe has "
        f"{sorted(subcommands())}")


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_cli_options_are_documented(command: str) -> None:
    parser = subcommands()[command]
    options = {a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]: a
               for a in parser._actions if a.option_strings and "--help" not in a.option_strings}
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in cli_sections()[command].splitlines() if re.match(r"\|\s*`--", line)]
    documented_options = {re.match(r"`(--[\w-]+)", row[0]).group(1): row[1] for row in rows}  # type: ignore[union-attr]
    assert set(documented_options) == set(options), (
        f"`{command}` options: the docs list {sorted(documented_options)}, the parser has {sorted(options)}")
    for option, cell in documented_options.items():
        default = options[option].default
        shown = re.match(r"`([^`]*)`", cell)
        if default is None or default is False:
            assert shown is None, f"`{command} {option}`: documented default {cell!r}, the parser's is {default!r}"
            continue
        expected = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        assert shown is not None and shown.group(1) == expected, (
            f"`{command} {option}`: documented default {cell!r}, the parser's is {expected!r}")


def test_cli_parser_is_found() -> None:
    assert "plan" in subcommands() and sys.modules["lightning_naspipe.__main__"]
