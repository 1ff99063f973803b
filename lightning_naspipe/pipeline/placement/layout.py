"""Stages x replicas: which process runs which pipeline stage, and which micro-batches it trains.

A world of ``S x D`` processes runs ``D`` replicas of an ``S``-stage pipeline. Ranks are stage-major,
as DeepSpeed, Megatron and torchtitan lay them out: the replicas of a stage sit on neighbouring ranks
(``rank = stage * D + replica``), so the per-subnet gradient reduction among them stays local. Each
replica is a whole pipeline (a *column*) and trains the same subnets on its own contiguous share of every
batch's ``chunks`` micro-batches; :mod:`.replicas` sums their gradients in micro-batch order.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """``stages`` pipeline stages times ``replicas`` data-parallel replicas, ranks stage-major.

    Attributes:
        stages: pipeline stages (``S``).
        replicas: data-parallel replicas of each stage (``D``).
    """

    stages: int
    replicas: int = 1

    @classmethod
    def of(cls, world_size: int, num_stages: int | None) -> Layout:
        """The layout of ``world_size`` processes with ``num_stages`` stages (``None``: one per process).

        Raises:
            NASPipeConfigError: ``num_stages`` is below 1 or does not divide ``world_size``.
        """
        stages = world_size if num_stages is None else num_stages
        if stages < 1 or world_size % stages:
            raise NASPipeConfigError(
                f"NASPipeStrategy(num_stages={num_stages}) with {world_size} processes (devices x num_nodes): the "
                "processes form num_stages stages times a number of replicas, so num_stages must divide "
                f"{world_size}; use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}, or leave "
                "it unset (one stage per process)."
            )
        return cls(stages, world_size // stages)

    @property
    def world_size(self) -> int:
        """All processes: ``stages * replicas``."""
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int = 0) -> int:
        """The global rank of ``stage``'s ``replica``."""
        return stage * self.replicas + replica

    def stage_of(self, rank: int) -> int:
        """The stage global rank ``rank`` runs."""
        return rank // self.replicas

    def replica_of(self, rank: int) -> int:
        """Which replica of its stage global rank ``rank`` is."""
        return rank % self.replicas

    def column(self, replica: int) -> list[int]:
        """The ranks of one pipeline (``replica``'s), in stage order."""
        return [self.rank(stage, replica) for stage in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks of ``stage``'s replicas, in replica order."""
        return [self.rank(stage, replica) for replica in range(self.replicas)]

    def name(self, rank: int) -> str:
        """How messages name global rank ``rank``: ``"stage 1 (rank 1)"``, with replicas
        ``"stage 1 replica 0 (rank 2)"``."""
        replica = f" replica {self.replica_of(rank)}" if self.replicas > 1 else ""
        return f"stage {self.stage_of(rank)}{replica} (rank {rank})"

    def check_chunks(self, chunks: int, subnets: int = 1) -> None:
        """Refuse ``chunks`` the replicas cannot share evenly in training steps of ``subnets`` subnets.

        Raises:
            NASPipeConfigError: ``chunks * subnets`` is not a multiple of :attr:`replicas`.
        """
        if chunks * subnets % self.replicas:
            multiples = [self.replicas * k for k in range(1, 4)]
            steps = f" x {subnets} subnets per training step" if subnets > 1 else ""
            raise NASPipeConfigError(
                f"The module's micro-batches per subnet (chunks={chunks}){steps} with {self.replicas} replicas per "
                f"stage ({self.stages} stages x {self.replicas} replicas = {self.world_size} processes): each replica "
                "trains an equal, contiguous share of every training step's micro-batches, so chunks must be a "
                f"multiple of {self.replicas}, e.g. {multiples}"
                + (f" (or train a multiple of {self.replicas} subnets per step)" if subnets > 1 else "")
                + f"; or set num_stages={self.world_size} for one replica."
            )

    def chunk_share(self, chunks: int, replica: int, subnets: int = 1) -> range:
        """The micro-batches of each training step that ``replica`` trains: a contiguous share, in order (a step of
        ``subnets`` subnets has ``subnets * chunks``, subnet by subnet, in the order their gradients accumulate)."""
        self.check_chunks(chunks, subnets)
        share = chunks * subnets // self.replicas
        return range(replica * share, (replica + 1) * share)
