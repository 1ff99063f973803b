"""Moved to :mod:`lightning_naspipe.planning.space_spec`; this name keeps existing imports working."""

from lightning_naspipe.planning.space_spec import *  # noqa: F403
from lightning_naspipe.planning.space_spec import __all__ as __all__
