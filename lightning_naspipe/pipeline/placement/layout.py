"""Stages x replicas: which process runs which pipeline stage, and which micro-batches it trains.

A world of ``S x D`` processes runs ``D`` replicas of an ``S``-stage pipeline. Each replica is a whole
pipeline (a *column*) and trains the same subnets on its own contiguous share of every batch's ``chunks``
micro-batches; :mod:`.replicas` sums their gradients in micro-batch order, by replica index, so which
rank runs which stage never changes a result.

On one node ranks are stage-major, as DeepSpeed, Megatron and torchtitan lay them out: the replicas of a
stage sit on neighbouring ranks (``rank = stage * D + replica``), so the per-subnet gradient reduction
among them stays local. On ``N`` nodes (each a contiguous block of ``S x D / N`` global ranks, as
Lightning and ``torchrun`` number them) the stage messages are the ones on every micro-batch's critical
path, so where ``S`` divides the processes per node ranks are replica-major instead
(``rank = replica * S + stage``): every pipeline lies inside one node and only the once-per-update
reduction crosses nodes. Where ``S`` does not divide them no order keeps every pipeline inside a node, and
ranks stay stage-major.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """``stages`` pipeline stages times ``replicas`` data-parallel replicas on ``nodes`` nodes.

    Attributes:
        stages: pipeline stages (``S``).
        replicas: data-parallel replicas of each stage (``D``).
        nodes: nodes the processes span, each a contiguous block of global ranks (see the module docstring for
            the rank order this chooses).
    """

    stages: int
    replicas: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.world_size % self.nodes:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise NASPipeConfigError(
                f"{self.world_size} processes ({self.stages} stages x {self.replicas} replicas) on num_nodes="
                f"{self.nodes}: every node runs the same number of processes, so num_nodes must divide "
                f"{self.world_size}; use one of {divisors}.")

    @classmethod
    def of(cls, world_size: int, num_stages: int | None, nodes: int = 1) -> Layout:
        """The layout of ``world_size`` processes on ``nodes`` nodes with ``num_stages`` stages (``None``: one per
        process).

        Raises:
            NASPipeConfigError: ``num_stages`` is below 1 or does not divide ``world_size``, or ``nodes`` does not.
        """
        stages = world_size if num_stages is None else num_stages
        if stages < 1 or world_size % stages:
            raise NASPipeConfigError(
                f"NASPipeStrategy(num_stages={num_stages}) with {world_size} processes (devices x num_nodes): the "
                "processes form num_stages stages times a number of replicas, so num_stages must divide "
                f"{world_size}; use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}, or leave "
                "it unset (one stage per process)."
            )
        return cls(stages, world_size // stages, nodes)

    @property
    def world_size(self) -> int:
        """All processes: ``stages * replicas``."""
        return self.stages * self.replicas

    @property
    def per_node(self) -> int:
        """Processes on each node."""
        return self.world_size // self.nodes

    @property
    def replica_major(self) -> bool:
        """Whether ranks are replica-major (``rank = replica * S + stage``): on several nodes where the stages
        divide the processes per node; else stage-major."""
        return self.nodes > 1 and self.per_node % self.stages == 0

    def rank(self, stage: int, replica: int = 0) -> int:
        """The global rank of ``stage``'s ``replica``."""
        return replica * self.stages + stage if self.replica_major else stage * self.replicas + replica

    def stage_of(self, rank: int) -> int:
        """The stage global rank ``rank`` runs."""
        return rank % self.stages if self.replica_major else rank // self.replicas

    def replica_of(self, rank: int) -> int:
        """Which replica of its stage global rank ``rank`` is."""
        return rank // self.stages if self.replica_major else rank % self.replicas

    def node_of(self, rank: int) -> int:
        """The node global rank ``rank`` runs on."""
        return rank // self.per_node

    @property
    def pipelines_in_nodes(self) -> bool:
        """Whether every pipeline (column) lies inside one node, so no stage message crosses nodes."""
        return all(len({self.node_of(r) for r in self.column(d)}) == 1 for d in range(self.replicas))

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
