"""The CSP schedule, pure Python: its vocabulary (actions), the schedules built from a window's subnets,
the rules every schedule keeps, and the lookahead that plans steps one after another.

Layer: schedule. May import the base modules and ``space`` only: no torch.distributed, no processes, so
it is tested as plain data. ``transport`` follows a schedule's send order; ``pipeline`` runs it.
"""

__all__: list[str] = []
