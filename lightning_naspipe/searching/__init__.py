"""After training: searchers, the search loop, its log and plot, and subnet export.

Layer: searching. May import the base modules, ``space``, ``transport`` and ``pipeline``; never
``planning`` or ``integration``, nor a Lightning namespace.
"""

__all__: list[str] = []
