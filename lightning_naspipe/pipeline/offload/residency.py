"""The offload policy for a window: prefetch and release by the schedule, and memory-bounded scheduling.

Every stage process knows the window's schedule, so it knows which resources each subnet needs
and when: :class:`WindowResidency` drives the stage's :class:`~.offload.Offloader` from it, and
:func:`memory_conflicts` adds conflicts so that what is in flight on a stage fits a byte budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.offload.offload import Offloader


def memory_conflicts(resources: Sequence[frozenset[Hashable]], sizes: Mapping[Hashable, int],
                     budget: int) -> list[frozenset[Hashable]]:
    """Resources with extra conflicts so that what is in flight on a stage fits ``budget``.

    Subnet ``i`` may start only when the union of the resources of every not-yet-updated subnet
    ``j..i`` fits. Updates run in subnet order, so that means waiting for ``U(j-1)``: expressed as a
    resource shared by ``j-1`` and ``i``, the CSP rule enforces it. The oldest unfinished subnet
    always fits alone, so this cannot deadlock.

    Raises:
        NASPipeConfigError: a single subnet's resources on the stage exceed the budget.
    """
    out = [set(r) for r in resources]
    for i, own in enumerate(resources):
        alone = sum(sizes.get(k, 0) for k in own)
        if alone > budget:
            raise NASPipeConfigError(
                f"One subnet needs about {alone} bytes of parameters, gradients and optimizer state on a stage, "
                f"more than offload_budget_bytes={budget}. Raise the budget or use more pipeline stages."
            )
        union: set[Hashable] = set(own)
        j = i
        while j > 0 and sum(sizes.get(k, 0) for k in union | resources[j - 1]) <= budget:
            j -= 1
            union |= resources[j]
        if j > 0:
            token = ("memory", i)
            out[j - 1].add(token)
            out[i].add(token)
    return [frozenset(r) for r in out]


class WindowResidency:
    """The prefetch/evict policy for one window on one stage, driven by the schedule.

    Args:
        offloader: the stage's offloader.
        forward_order: window subnets in the order of their first forward on this stage.
        resources: per window subnet, its resource keys on this stage.
        lookahead: how many upcoming subnets to prefetch for.
    """

    def __init__(self, offloader: Offloader, forward_order: Sequence[int], resources: Sequence[frozenset[Hashable]],
                 lookahead: int = 2) -> None:
        self.offloader = offloader
        self.order = list(forward_order)
        self.resources = resources
        self.lookahead = lookahead
        self._started = 0
        self._in_flight: set[int] = set()
        if self.order:
            offloader.prefetch(self._upcoming_keys())

    def _upcoming_keys(self) -> list[Hashable]:
        upcoming = self.order[self._started: self._started + self.lookahead]
        return [key for k in upcoming for key in sorted(self.resources[k], key=repr)]

    def before_forward(self, subnet: int) -> None:
        """Subnet ``subnet`` starts its first forward on this stage."""
        self.offloader.acquire(self.resources[subnet])
        self._in_flight.add(subnet)
        self._started = self.order.index(subnet) + 1
        self.offloader.prefetch(self._upcoming_keys())

    def after_update(self, subnet: int) -> None:
        """Subnet ``subnet`` has been updated on this stage; its resources may go."""
        self._in_flight.discard(subnet)
        self.offloader.note_update(self.resources[subnet])
        keep = {key for k in self._in_flight for key in self.resources[k]} | set(self._upcoming_keys())
        self.offloader.release(self.resources[subnet], keep=keep)

    def finish(self) -> None:
        self.offloader.evict_all()
