"""Telling every stage why the pipeline stopped.

A stage that raises ends its process; its neighbours only see a link go quiet and raise
:class:`~.p2p.StageFailure`. Rank 0 is the process the user watches, so the failing stage
posts its error to the process group's key-value store (held by rank 0 under Lightning's
launchers and torchrun) and a stage that loses a neighbour reads the posts before it raises.
Everything here is best effort: a store that cannot be reached only loses the explanation.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from lightning_naspipe.compat.torch import default_store as default_store  # the store, or None

_PREFIX = "lightning_naspipe/failed"
# Every stage process builds its transports in the same order, so the n-th board of each process
# belongs to the same run and a later fit never reads an earlier one's posts.
_boards = itertools.count()


class FailureBoard:
    """Posts and reads the errors that stopped stage processes, keyed by rank.

    Args:
        store: a ``torch.distributed.Store`` every stage process reaches, or ``None`` (posts are dropped).
        rank: this process's rank.
        names: how to name each rank, indexed by it (e.g. ``"stage 1 (rank 1)"``).
    """

    def __init__(self, store: Any, rank: int, names: Sequence[str]) -> None:
        self.store = store
        self.rank = rank
        self.names = list(names)
        self._key = f"{_PREFIX}/{next(_boards)}"
        self.posted = False

    def post(self, error: BaseException) -> None:
        """Record that ``error`` stopped this stage (the first error only)."""
        if self.store is None or self.posted:
            return
        self.posted = True
        text = f"{type(error).__name__}: {error}".strip()
        try:
            self.store.set(f"{self._key}/{self.rank}", text[:4000])
        except Exception:  # noqa: BLE001 - the store's host may be gone too; the explanation is optional
            pass

    def causes(self, wait_s: float = 1.0) -> list[str]:
        """What other stages posted, waiting up to ``wait_s`` for a first post (it may be on its way)."""
        if self.store is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            found = []
            for rank, name in enumerate(self.names):
                key = f"{self._key}/{rank}"
                try:
                    if rank != self.rank and self.store.check([key]):
                        found.append(f"Pipeline {name} raised {self.store.get(key).decode()}")
                except Exception:  # noqa: BLE001 - unreachable store: no explanation
                    return found
            # A stage that only lost a neighbour posts that too: it is the explanation only when no
            # stage posted an error of its own (e.g. for a stage resumed after SIGSTOP, whose
            # neighbours gave up on it).
            primary = [cause for cause in found if " raised StageFailure: " not in cause]
            if primary or (found and time.monotonic() >= deadline):
                return primary or found
            if time.monotonic() >= deadline:
                return []
            time.sleep(0.05)


def explained(failures: FailureBoard | None, otherwise: str = "") -> str:
    """What other processes posted to ``failures``, each on a line of its own after the message it ends;
    ``otherwise`` when none did (or there is no board)."""
    causes = failures.causes() if failures is not None else []
    return "".join(f"\n{cause}" for cause in causes) if causes else otherwise
