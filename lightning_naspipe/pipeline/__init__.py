"""The engine and its scheduling: actions, schedules, the executor, the engine and its helpers.

Layer: pipeline. May import the base modules, ``space`` and ``transport``; never ``planning``,
``searching`` or ``integration``, nor a Lightning namespace (``lightning``, ``pytorch_lightning``,
``lightning_fabric``). ``lightning_utilities`` is a plain utility package and allowed.
"""

__all__: list[str] = []
