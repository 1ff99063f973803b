"""What users write: the supernet, its choices, cells and freezing; and the boundary between two blocks.

Layer: space. May import only the base modules (``lightning_naspipe.errors``,
``lightning_naspipe.namespaces``); never the schedule, pipeline, transport, planning, searching or
integration subpackages, nor a Lightning namespace.
"""

__all__: list[str] = []
