"""The map of test kinds (tests/conftest.py, explained in tests/README.md) covers every test module, and only those."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import KIND_OF_MODULE, KINDS

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_kind_and_every_kind_a_module() -> None:
    modules = {path.stem for path in TESTS.glob("test_*.py")}
    assert sorted(modules - set(KIND_OF_MODULE)) == [], "add these to KIND_OF_MODULE in tests/conftest.py"
    assert sorted(set(KIND_OF_MODULE) - modules) == [], "KIND_OF_MODULE names modules that do not exist"
    assert set(KIND_OF_MODULE.values()) == set(KINDS)


def test_a_collected_test_carries_exactly_one_kind(request: pytest.FixtureRequest) -> None:
    kinds = [kind for kind in KINDS if request.node.get_closest_marker(kind) is not None]
    assert kinds == ["unit"]
