"""Between stage processes: the wire format, the point-to-point links in a schedule's send order, the
collectives, and the board where a failing stage leaves its error.

Layer: transport. May import the base modules, ``space`` and ``schedule``; never the pipeline, planning,
searching or integration, nor a Lightning namespace.
"""

__all__: list[str] = []
