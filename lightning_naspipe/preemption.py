"""SIGTERM (preemption, a scheduler's cancel) on any or all stages: the stages agree, then stop together.

Lightning's SIGTERM handler broadcasts from inside the signal handler, on whichever rank got the
signal, which collides with the pipeline's own traffic: the run hung until ``timeout`` and wrote no
checkpoint. Under NASPipe the handler only records the signal. At each window boundary, where
Lightning would broadcast rank 0's flag, the stages all-reduce theirs instead (one collective, as
before), so a signal to any stage stops every stage at the same boundary: ``received_sigterm`` is
set and Lightning's ``SIGTERMException`` raised everywhere, Lightning's exception callbacks run
(``OnExceptionCheckpoint`` writes a checkpoint that resumes bitwise) and every process exits.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lightning_naspipe.namespaces import Namespace

__all__ = ["SigtermAgreement"]


class SigtermAgreement:
    """Installed on every stage of a multi-stage fit by the strategy (``on_train_start``).

    Args:
        namespace: the Trainer's namespace (for its ``SIGTERMException``).
        device: where the flag is reduced (the stage's device: NCCL reduces device tensors).
    """

    def __init__(self, namespace: Namespace, device: torch.device) -> None:
        self.namespace = namespace
        self.device = device
        self.requested = False

    def install(self, trainer: Any) -> None:
        """Replace Lightning's SIGTERM handler and its per-batch broadcast (private Lightning APIs)."""
        connector = trainer._signal_connector
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGTERM)
            # Lightning composes its notifier (the broadcast) with the handlers found before it: keep those.
            kept = [h for h in getattr(current, "signal_handlers", [current]) if h != connector._sigterm_notifier_fn]

            def record(signum: int, frame: FrameType | None) -> None:
                self.requested = True
                for handler in kept:
                    handler = signal.getsignal(handler) if isinstance(handler, int) else handler
                    if callable(handler):
                        handler(signum, frame)

            signal.signal(signal.SIGTERM, record)
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: self.agree(trainer)

    def agree(self, trainer: Any) -> None:
        """Collective, at a window boundary: stop every stage if any stage got SIGTERM."""
        flag = torch.tensor([1 if self.requested else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            trainer._signal_connector.received_sigterm = True
            raise self.namespace.pytorch_module("utilities.exceptions").SIGTERMException()
