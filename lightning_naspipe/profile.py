"""Moved to :mod:`lightning_naspipe.planning.profile`; this name keeps existing imports working."""

from lightning_naspipe.planning.profile import *  # noqa: F403
from lightning_naspipe.planning.profile import __all__ as __all__
