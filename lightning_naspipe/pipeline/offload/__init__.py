"""Offloading resources a window does not use: the offloader, its copier and window residency.

Layer: pipeline (same rules as :mod:`lightning_naspipe.pipeline`).
"""

__all__: list[str] = []
