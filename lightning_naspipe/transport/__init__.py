"""Between blocks and stage processes: block boundaries, the wire format, the point-to-point links,
the collectives, and the board where a failing stage leaves its error.

Layer: transport. May import the base modules and ``space``, and of the pipeline only
``pipeline.actions`` (the schedule's vocabulary: ``Schedule``, ``NORMS``; it imports nothing).
Never the rest of the pipeline, planning, searching or integration, nor a Lightning namespace.
"""

__all__: list[str] = []
