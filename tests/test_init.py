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
