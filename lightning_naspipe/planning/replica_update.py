"""What a subnet's update costs data-parallel replicas beyond the streamed sum of its gradients.

:func:`.links.streamed_chain_ms` prices the gradient bytes on the links. Measured on a 2-core CPU host
(``benchmarks/replica_update.py``), three more costs made an update 10-15 ms where the bytes alone were ~1 ms:

* **the slowest replica:** every replica waits for the last to reach the update; per-subnet compute varies between
  processes (noise, the other process's work), so the update starts at the expected maximum of ``D`` draws, about
  ``spread x compute x E[max of D standard normals]`` after the mean (``SpaceSpec.replica_spread``);
* **BatchNorm statistics replay:** each later replica replays its micro-batches' running-statistics updates in turn,
  ``D - 1`` shares one after another, while the others wait (``CandidateSpec.replay_ms``, timed by the profile);
* **per-tensor work:** every gradient tensor and BatchNorm buffer is packed, sent, unpacked and copied on each of the
  ``2 (D - 1)`` hops down the chain and back (``SpaceSpec.grad_tensor_ms`` and ``statistics_tensor_ms``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from statistics import NormalDist

from lightning_naspipe.planning.space_spec import CandidateSpec, SpaceSpec

__all__ = ["expected_maximum", "replica_update_ms"]


@functools.cache
def expected_maximum(draws: int) -> float:
    """The expected maximum of ``draws`` standard normal draws (Blom's approximation: 0.59 for 2, within 5%)."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    return NormalDist().inv_cdf((draws - 0.375) / (draws + 0.25)) if draws > 1 else 0.0


def replica_update_ms(spec: SpaceSpec, ops: Sequence[CandidateSpec], replicas: int, scale: float = 1.0) -> float:
    """Milliseconds a subnet's update on a stage holding ``ops`` costs each of ``replicas`` replicas beyond
    :func:`.links.streamed_chain_ms`. ``spec``'s compute is one replica's share; ``scale`` multiplies it (the
    planner's shared-core slowdown). 0 for one replica."""
    if replicas <= 1:
        return 0.0
    compute = scale * sum(o.forward_ms + o.backward_ms for o in ops)
    slowest = spec.replica_spread * expected_maximum(replicas) * compute
    replay = (replicas - 1) * scale * sum(o.replay_ms for o in ops)
    tensors = 2 * (replicas - 1) * sum(spec.grad_tensor_ms * o.grad_tensors
                                       + spec.statistics_tensor_ms * o.statistics_tensors for o in ops)
    return slowest + replay + tensors
