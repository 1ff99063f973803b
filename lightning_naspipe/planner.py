"""Moved to :mod:`lightning_naspipe.planning.planner`; this name keeps existing imports working."""

from lightning_naspipe.planning.planner import *  # noqa: F403
from lightning_naspipe.planning.planner import __all__ as __all__
