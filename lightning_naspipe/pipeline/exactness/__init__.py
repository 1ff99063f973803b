"""What keeps a pipelined update bitwise equal to the one-device one: replicas' ordered gradient sums,
weights tied across stages, gradient clipping and the global norm, deferred weight gradients, distillation
teachers, and the refusal of ``compute_loss`` state that would differ.

Layer: pipeline (same rules as :mod:`lightning_naspipe.pipeline`).
"""

__all__: list[str] = []
