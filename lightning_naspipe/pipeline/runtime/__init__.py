"""The runtime of one stage: the engine that trains windows, the stage executor that runs a schedule's
actions, windows and their plans, micro-batches, per-subnet optimizer updates and telemetry.

Layer: pipeline (same rules as :mod:`lightning_naspipe.pipeline`).
"""

__all__: list[str] = []
