"""Training a window of subnets on one stage, by role:

* ``runtime``: the engine, the stage executor, windows, micro-batches, optimizer steps and telemetry;
* ``exactness``: what makes a pipelined update equal the one-device one (replicas' ordered sums, tied
  weights, clipping and global norms, deferred weight gradients, distillation, ``compute_loss``'s state);
* ``placement``: which stage and replica own which blocks (partition, layout, moving blocks, the stage table);
* ``sampling``: counter-keyed randomness (subnets, dropout, Python's and NumPy's generators) and step samplers;
* ``offload``: resources a window does not use, kept in host memory.

Layer: pipeline. May import the base modules, ``space``, ``schedule`` and ``transport``; never ``planning``,
``searching`` or ``integration``, nor a Lightning namespace (``lightning``, ``pytorch_lightning``,
``lightning_fabric``). ``lightning_utilities`` is a plain utility package and allowed.
"""

__all__: list[str] = []
