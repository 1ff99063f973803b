"""Preemption signals on any or all stages: the stages agree at a window boundary, then act together.

Lightning's SIGTERM handler broadcasts from inside the signal handler, on whichever rank got the
signal, and its SLURM requeue handler (``SIGUSR1`` by default) saves a checkpoint there, a
collective. Both collide with the pipeline's own traffic: the run hung until ``timeout`` and wrote
no checkpoint. Under NASPipe the handlers only record the signal. Each stage's flags travel with
the window's losses at its end (:meth:`.p2p.P2PTransport.share_window_end`, no collective; up
the pipeline one window behind, so a signal on stage ``s`` of ``N`` is agreed ``N - 1 - s`` windows
later), and where Lightning would broadcast rank 0's SIGTERM flag before the next window, every stage
acts on the agreed flags, so a signal to any stage acts on every stage at the same boundary:

* SIGTERM: ``received_sigterm`` is set and Lightning's ``SIGTERMException`` raised everywhere,
  Lightning's exception callbacks run (``OnExceptionCheckpoint`` writes a checkpoint that resumes
  bitwise) and every process exits.
* The requeue signal: Lightning's own requeue handler runs on every stage there (the HPC checkpoint,
  then ``scontrol requeue`` on rank 0), and training goes on.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from lightning_naspipe.compat import lightning
from lightning_naspipe.namespaces import Namespace

__all__ = ["SigtermAgreement"]

_Handler = Callable[[int, FrameType | None], Any]


class SigtermAgreement:
    """Installed on every stage of a multi-stage fit by the strategy (``on_train_start``).

    Args:
        namespace: the Trainer's namespace (for its ``SIGTERMException``).
    """

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.requested = False
        #: The requeue signal arrived; Lightning's requeue handler waits for the next boundary.
        self.requeue_requested = False
        self._requeue: _Handler | None = None
        self._requeue_signum = 0
        self._agreed = (False, False)

    def install(self, trainer: Any) -> None:
        """Replace Lightning's signal handlers and its per-batch broadcast (private Lightning APIs)."""
        sigterm, requeue = lightning.signal_handlers(trainer)
        if threading.current_thread() is threading.main_thread():
            self._defer(signal.SIGTERM, sigterm, self._note_sigterm, always=True)
            environment = lightning.cluster_environment(trainer)
            signum = getattr(environment, "requeue_signal", None) or signal.SIGUSR1
            if self._defer(signum, requeue, self._note_requeue):
                self._requeue, self._requeue_signum = requeue, int(signum)
        lightning.replace_sigterm_broadcast(trainer, lambda: self.agree(trainer))

    def _note_sigterm(self) -> None:
        self.requested = True

    def _note_requeue(self) -> None:
        self.requeue_requested = True

    def _defer(self, signum: int, deferred: _Handler, note: Callable[[], None], always: bool = False) -> bool:
        """Make ``signum`` call ``note`` instead of ``deferred``; the other handlers still run at once.
        Returns whether the handler was replaced (only where ``deferred`` is installed, unless ``always``)."""
        current = signal.getsignal(signum)
        # Lightning composes its handler with the ones found before it: keep those.
        handlers = list(getattr(current, "signal_handlers", [current]))
        kept = [h for h in handlers if h != deferred]
        if len(kept) == len(handlers) and not always:
            return False

        def record(received: int, frame: FrameType | None) -> None:
            note()
            for handler in kept:
                handler = signal.getsignal(handler) if isinstance(handler, int) else handler
                if callable(handler):
                    handler(received, frame)

        signal.signal(signum, record)
        return True

    def flags(self) -> tuple[int, int]:
        """This stage's signals so far, for the agreement at a window's end (:class:`.window_end.BoundarySignals`)."""
        return int(self.requested), int(self.requeue_requested)

    def agreed(self, flags: Sequence[int]) -> None:
        """The stages' signals OR'ed at the window's end; acted on at the next boundary (:meth:`agree`)."""
        self._agreed = (bool(flags[0]), bool(flags[1]))

    def agree(self, trainer: Any) -> None:
        """Before each window (Lightning's per-batch SIGTERM check): act on what the stages agreed at
        the end of the last one, the same on every stage. No collective."""
        (terminate, requeue), self._agreed = self._agreed, (False, False)
        if requeue and self._requeue is not None:
            self.requeue_requested = False
            self._requeue(self._requeue_signum, None)  # every stage here: its checkpoint save is collective
        if terminate:
            lightning.mark_sigterm_received(trainer)
            raise self.namespace.pytorch_module("utilities.exceptions").SIGTERMException()
