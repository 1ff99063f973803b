"""Which process owns which blocks: the partition into stages, the stages x replicas layout, moving
blocks between stages, and the stage table logged after the first window.

Layer: pipeline (same rules as :mod:`lightning_naspipe.pipeline`).
"""

__all__: list[str] = []
