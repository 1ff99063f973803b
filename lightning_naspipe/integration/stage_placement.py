"""The placement half of ``NASPipeStrategy``: which stage owns which blocks, moving them, and gathering
them whole for checkpoints.

The strategy starts on a split (an explicit ``balance``, timed blocks of ``supernet_example_input``, or
parameter counts) and may move blocks twice over: to the split timed on the first batch, and after the first
two windows and every ``rebalance_every`` windows off a stage whose measured busy time makes it the bottleneck
(one edge block per check). Each move hands
weights, buffers and optimizer state to the new owner (:mod:`.placement`), so results never depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer
from typing_extensions import override

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.binding import NamespaceBinding
from lightning_naspipe.transport.distributed import (drop_foreign_state, gather_objects, gather_optimizer_state,
                                                     sync_stage_weights)
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.pipeline.offload.offload import Offloader, estimated_bytes
from lightning_naspipe.pipeline.placement.partition import shared_buffer_cuts
from lightning_naspipe.pipeline.placement.moves import first_blocks, move_blocks, place_module, rebalanced
from lightning_naspipe.integration.processes import saving_is_collective
from lightning_naspipe.space.supernet import supernet_of


class StagePlacement(NamespaceBinding):
    """Blocks per stage for ``NASPipeStrategy``, whose ``__init__`` calls :meth:`_init_placement`."""

    #: Whether every rank holds every block's current weights and optimizer state: always but between a
    #: multi-stage fit's setup and its training end, when a stage keeps only its own blocks current.
    _whole: bool = True
    #: How many tensors the last :meth:`sync_weights` sent.
    weights_sent: int = 0

    def _init_placement(self, offload: bool, offload_budget_bytes: int | None, rebalance_every: int | None) -> None:
        """This part's settings (``NASPipeStrategy``'s arguments of the same names) and its state before ``setup``."""
        self.offload = offload
        self.offload_budget_bytes = offload_budget_bytes
        self.rebalance_every = rebalance_every
        #: This stage's engine, built at ``setup``.
        self.engine: Engine | None = None
        #: The blocks of every stage, in stage order.
        self.stage_ranges: list[range] = []
        #: The block costs the split balances, and their unit (``"ms"`` or ``"params"``).
        self._split_costs: tuple[list[float], str] = ([], "params")
        #: Every stage's busy seconds at the last rebalancing check.
        self._busy_before: list[float] = []

    def _build_offloader(self) -> None:
        assert self.engine is not None
        supernet = supernet_of(self.lightning_module)
        optimizer = self.optimizers[0] if self.optimizers else None
        # Every stage process computes every stage's sizes from shapes alone: same schedule everywhere.
        sizes = [{key: estimated_bytes(state, optimizer) for key, state in supernet.stage_resources(b).items()}
                 for b in self.stage_ranges]
        if self.engine.offloader is not None:
            self.engine.offloader.close()
        self.engine.offloader = Offloader(supernet.stage_resources(self.engine.blocks), optimizer,
                                          self.root_device, self.offload_budget_bytes, sizes[self.stage])
        if self.offload_budget_bytes is not None:
            self.engine.memory_budget = (self.offload_budget_bytes, sizes)

    def _rebalances_before(self, window: int) -> bool:
        """Whether the busy times are checked before the ``window``-th window of the fit (1-based): after the
        first two windows, early, and then every ``rebalance_every``."""
        return bool(self.rebalance_every) and self.layout.stages > 1 and (
            window == 3 or window % (self.rebalance_every or 1) == 0)

    def _rebalance(self) -> None:
        """Move one block off the busiest stage if its measured busy time says it is clearly the
        bottleneck (collective; every rank decides alike from the same gathered times)."""
        assert self.engine is not None
        by_rank = gather_objects(self.engine.busy_s, self.world_size)
        busy = [max(by_rank[rank] for rank in self.layout.replica_ranks(s)) for s in range(self.layout.stages)]
        since = [b - a for a, b in zip(self._busy_before, busy)]
        self._busy_before = busy
        supernet = supernet_of(self.lightning_module)
        ranges = rebalanced(self.stage_ranges, since, self._split_costs[0], shared_buffer_cuts(supernet))
        if ranges is not None:
            shares = ", ".join(f"{b:.2f}" for b in since)
            self._move_to(ranges, f"rebalanced: stage busy seconds over the last {self.rebalance_every} windows "
                                  f"were {shares}")

    def _move_to(self, ranges: list[range], why: str) -> None:
        """Hand blocks to their stages in ``ranges``, with weights and optimizer state (collective)."""
        assert self.engine is not None
        if ranges == self.stage_ranges:
            return
        before = [len(r) for r in self.stage_ranges]
        supernet = supernet_of(self.lightning_module)
        move_blocks(supernet, self.optimizers[0] if self.optimizers else None, self.stage_ranges, ranges,
                    self.stage, self.root_device, on_device=not self.offload, ranks=self.layout.column(0),
                    world_size=self.world_size)
        self.stage_ranges = self.engine.stage_blocks = ranges
        supernet.local_blocks = self.engine.blocks
        if self.offload:
            self._build_offloader()
        self._info(f"NASPipe: blocks per stage {[len(r) for r in ranges]} (was {before}), {why}.")

    @override
    def model_to_device(self) -> None:
        # Only this stage's blocks go to the device (none with offload: the offloader moves them on demand).
        assert self.lightning_module is not None
        own = range(0) if self.offload else self.engine.blocks if self.engine is not None else None
        place_module(self.lightning_module, supernet_of(self.lightning_module), own, self.root_device)
        lightning.set_module_device(self.lightning_module, self.root_device)  # what its device property reads

    def _owned(self) -> set[int]:
        assert self.engine is not None
        supernet = supernet_of(self.lightning_module)
        first, own = first_blocks(list(supernet.blocks)), self.engine.blocks
        # A weight tied to an earlier stage's block is that stage's: this one holds a copy, no optimizer state.
        return {id(p) for i in own for p in supernet.blocks[i].parameters() if first[id(p)] in own}

    def _release_engine(self) -> None:
        """Close the engine's offloader and links (no copy thread, no shared memory left)."""
        if self.engine is None:
            return
        if self.engine.offloader is not None:
            self.engine.offloader.close()
            self.engine.offloader = None
        if self.engine.transport is not None:
            self.engine.transport.close()
            self.engine.transport = None
        self.engine.close()


    def _make_whole(self) -> None:
        """Give every rank every block's weights and optimizer state (collective)."""
        self.sync_weights()
        if self.layout.stages > 1 and self.optimizers:
            # The optimizer state too, so that a later validate/test/predict (which splits the blocks anew, by
            # parameters) or another layout loses none of a block the timed split had moved.
            inner = lightning.wrapped_optimizer(self.optimizers[0])
            inner.load_state_dict(gather_optimizer_state(inner, self._owned(), self.root_device))
        supernet_of(self.lightning_module).local_blocks = None  # whole again
        self._whole = True

    # -- checkpoints ----------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._whole:
            with saving_is_collective():
                self.sync_weights()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner: Optimizer = lightning.wrapped_optimizer(optimizer)
        if self._whole:  # one stage, or outside a fit's training: every rank holds all of it
            return inner.state_dict()
        with saving_is_collective():
            return gather_optimizer_state(inner, self._owned(), self.root_device)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if not self._whole:
            drop_foreign_state(self.optimizers[0], self._owned())
        if self.engine is not None and self.engine.offloader is not None:
            self.engine.offloader.rehost()

    def sync_weights(self) -> None:
        """Give every rank the full, current weights (collective): each stage sends the tensors of the resources
        any stage's windows changed since the last sync (the engine's record, agreed by every rank), no others."""
        if self.layout.stages == 1:
            return
        supernet = supernet_of(self.lightning_module)
        only = None
        if self.engine is not None:
            changed = set().union(*gather_objects(self.engine.changed, self.world_size))
            only = {id(t) for key in changed for t in supernet.resource_state(key).tensors()}
        self.weights_sent = sync_stage_weights(list(supernet.blocks), self.stage_ranges, self.layout.column(0),
                                               self.root_device, only)
        if self.engine is not None:
            self.engine.changed.clear()
