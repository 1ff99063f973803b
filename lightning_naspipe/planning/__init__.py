"""Planning: a space's costs measured (``profile``, ``block_cost``) and its pipeline predicted (``planner``).

``space_spec`` describes a space by costs, with the one reduction of timings to costs
(:func:`candidate_ms`, :func:`block_cost_ms`) that the stage split, the profile and the planner all use;
``block_cost`` times blocks as training runs them; ``profile`` measures a :class:`SpaceSpec`; ``planner``
simulates the CSP schedule on it; ``block_timing`` times the default stage split's block weights at the start of a run.

Layer: planning. May import the base modules, ``space``, ``transport`` and ``pipeline``; never ``searching`` or
``integration``, nor a Lightning namespace. Nothing below it imports it: of the training-time code only the
Lightning glue (``integration``) does, for the timed split.
"""

from lightning_naspipe.planning.planner import Prediction, plan, simulate, table
from lightning_naspipe.planning.profile import profile_supernet
from lightning_naspipe.planning.space_spec import (BlockSpec, CandidateSpec, SpaceSpec, block_cost_ms, candidate_ms,
                                                   wide_spec)

__all__ = ["BlockSpec", "CandidateSpec", "Prediction", "SpaceSpec", "block_cost_ms", "candidate_ms", "plan",
           "profile_supernet", "simulate", "table", "wide_spec"]
