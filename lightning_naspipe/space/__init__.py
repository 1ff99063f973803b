"""What users write: the supernet, its choices, cells and freezing.

Layer: space. May import only the base modules (``lightning_naspipe.errors``,
``lightning_naspipe.namespaces``); never the pipeline, transport, planning, searching or
integration subpackages, nor a Lightning namespace.
"""

__all__: list[str] = []
