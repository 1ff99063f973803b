"""Counter-keyed randomness: subnets, dropout masks and Python's and NumPy's global generators as pure
functions of (seed, counters), and the step samplers (sandwich rule, FairNAS, constrained).

Layer: pipeline (same rules as :mod:`lightning_naspipe.pipeline`).
"""

__all__: list[str] = []
