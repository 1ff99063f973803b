"""One process per pipeline stage: launching, ranks, the process group and collectives.

The part of :class:`~.strategy.NASPipeStrategy` that is about processes, not about the pipeline:
Lightning's own launchers (or ``torchrun``, SLURM, ...), gloo on CPU and NCCL on CUDA, and the
strategy collectives Lightning calls (``reduce``, ``barrier``, ``broadcast``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.affinity import core_share, pin_process
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import Namespace
from lightning_naspipe.pipeline.placement.layout import Layout
from lightning_naspipe.transport.failures import FailureBoard, explained
from lightning_naspipe.transport.p2p import StageFailure

TBroadcast = TypeVar("TBroadcast")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_REPORT_LAST_S = 3.0  # how long rank 0 waits for its failing stage processes before reporting
#: How long Lightning's process observer lets rank 0 report a failed stage before it kills all
#: (detection is immediate, the report takes ``_REPORT_LAST_S`` plus the store's 1 s and teardown).
_OBSERVER_GRACE_S = 15.0

if TYPE_CHECKING:  # checked against one namespace's API; at run time a mixin for either (strategy.py)
    from pytorch_lightning.strategies import ParallelStrategy as _StrategyBase
else:
    _StrategyBase = object


#: Longer waits are for a neighbour's whole stage of work (a CSP conflict), where one wake-up weighs little.
_RECEIVE_SPIN_S = 0.005


class StageProcesses(lightning.LauncherHook, _StrategyBase):
    """The process half of a parallel strategy with one process per stage; every process sees the whole data.

    A mixin for a namespace's ``ParallelStrategy`` (see :mod:`.namespaces`): the launchers and the
    fabric's process-group helpers come from ``_namespace``, so one namespace is never mixed with
    the other's. A subclass's ``__init__`` calls :meth:`_init_processes`.
    """

    #: The Lightning namespace served: set on the bound classes (:mod:`.binding`), ``None`` before binding.
    _namespace: ClassVar[Namespace | None] = None
    #: The CPU affinity before this process pinned itself (``_pin_to_cores``); restored at teardown.
    _affinity_before: set[int] | None = None
    #: The stage processes this one launched (rank 0 under Lightning's popen launcher).
    _children: Sequence[subprocess.Popen[bytes]] = ()
    #: Marks a strategy with one process per stage; ``searching.search_loop`` checks it without
    #: importing this module (searching sits below the Lightning glue).
    _naspipe_stage_processes: bool = True

    def _init_processes(self, num_stages: int | Literal["auto"] | None, timeout: timedelta,
                        process_group_backend: str | None,
                        start_method: Literal["popen", "spawn", "fork", "forkserver"]) -> None:
        """This part's settings (``NASPipeStrategy``'s arguments of the same names); one node until the
        Trainer sets ``num_nodes``."""
        self.num_stages = num_stages
        #: The stages of the layout in use (``None``: one per process); ``num_stages="auto"`` sets it when it chooses.
        self._stages = None if num_stages == "auto" else num_stages
        self.timeout = timeout
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self._num_nodes = 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices"
        return self.parallel_devices[self.local_rank]

    @property
    def receive_spin_s(self) -> float:
        """How long a receive polls before it sleeps: spinning saves each message a wake-up, which
        matters most where every message is on the critical path (a trainable stem and head), but only
        on cores this process has to itself (pinned, see :mod:`.affinity`) does it take no time from
        another stage."""
        return _RECEIVE_SPIN_S if self._affinity_before is not None else 0.0

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a sharding DistributedSampler for distributed strategies; every stage
        # must see the whole batch sequence of the one-device run, so never.
        return False

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layout(self) -> Layout:
        """Stages x replicas of this run on the Trainer's ``num_nodes`` (:class:`.Layout`, which orders the ranks)."""
        return Layout.of(self.world_size, self._stages, self.num_nodes)

    @property
    def stage(self) -> int:
        """This process's pipeline stage."""
        return self.layout.stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        """Which data-parallel replica of its stage this process is (0 with one replica per stage)."""
        return self.layout.replica_of(self.global_rank)

    def choose_launcher(self) -> Any:
        """Lightning's own launchers, as its strategies choose them (see :class:`.compat.lightning.LauncherHook`)."""
        assert self.cluster_environment is not None
        assert self._namespace is not None, "bound by the Trainer"
        if self.num_processes * self.num_nodes == 1 and not self.cluster_environment.creates_processes_externally:
            # Nothing to launch. Lightning's launchers would also change the intra-op thread count
            # (OMP_NUM_THREADS), and with it the float results of CPU kernels.
            return None
        if self._start_method == "popen":
            return lightning.subprocess_launcher(self._namespace, self.cluster_environment, self.num_processes,
                                                 self.num_nodes)
        return lightning.multiprocessing_launcher(self._namespace, self, self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # One rank_zero_only (lightning_utilities') serves both namespaces' rank_zero_* helpers.
        lightning.set_rank_zero_rank(self.global_rank)

    @override
    def setup_environment(self) -> None:
        Layout.of(self.world_size, self._stages)  # refuses a num_stages that does not divide the processes
        super().setup_environment()  # the namespace's ParallelStrategy
        if self.local_rank > 0:
            exit_with_parent()
        self._children = lightning.launched_processes(self)  # Lightning's popen launcher, rank 0
        if self._children:
            atexit.register(reap, self._children)
            delay_observer_kill(_OBSERVER_GRACE_S)
        if self.world_size > 1:
            self._pin_to_cores()  # before the process group starts its threads: they inherit the pinning
            assert self._namespace is not None, "bound by the Trainer"
            self.set_world_ranks()
            backend = self._process_group_backend or lightning.default_backend(self._namespace, self.root_device)
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            lightning.init_process_group(self._namespace, self.cluster_environment, backend, self.timeout)

    def _pin_to_cores(self) -> None:
        """On CPU, pin this stage process to its own share of the cores (see :mod:`.affinity`)."""
        if self.root_device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
            return
        cores = core_share(sorted(os.sched_getaffinity(0)), self.local_rank, self.num_processes,
                           torch.get_num_threads())
        if cores is not None:
            self._affinity_before = pin_process(cores)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, StageFailure):
            # Rank 0 is the process the user watches: give the stages it launched, which stop on the
            # same failure, a moment to print their own errors, so that rank 0's report is shown last.
            wait_for_exit(self._children, _REPORT_LAST_S)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._affinity_before is not None:  # e.g. a notebook's process, started with start_method="fork"
            pin_process(sorted(self._affinity_before))
            self._affinity_before = None
        super().teardown()

    # -- collectives ----------------------------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            assert self._namespace is not None, "bound by the Trainer"
            return lightning.sync_ddp(self._namespace, tensor, group, reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            with saving_is_collective() if name == "Trainer.save_checkpoint" else contextlib.nullcontext():
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]


@contextlib.contextmanager
def saving_is_collective() -> Iterator[None]:
    """Around the collectives of ``trainer.save_checkpoint``: a stage process that does not join them (the
    call made only where ``trainer.is_global_zero``) fails the save with an error that says so, instead of
    gloo's "connection closed" or a timeout."""
    try:
        yield
    except RuntimeError as error:
        raise NASPipeConfigError(
            "trainer.save_checkpoint is collective under NASPipeStrategy with several stages, and another stage "
            "process did not join it: call it on every process (not only where trainer.is_global_zero is True); "
            "rank 0 writes the file. Lightning's checkpoint callbacks already do so."
        ) from error


@contextlib.contextmanager
def lost_process_named(failures: FailureBoard | None, what: str) -> Iterator[None]:
    """Around the strategy's own collectives during training (choosing the layout, timing the split, rebalancing):
    a process that failed or died there ends the run with a :class:`StageFailure` that names it (from the failure
    board, where a failing process posts its error), not with gloo's or NCCL's connection error."""
    try:
        yield
    except (StageFailure, NASPipeConfigError):
        raise
    except RuntimeError as error:  # torch.distributed's errors (DistBackendError is one)
        raise StageFailure(f"Pipeline stage processes failed or exited during {what}: another process stopped "
                           f"answering ({str(error).splitlines()[0] if str(error) else type(error).__name__})."
                           + explained(failures, " See the other processes' error output for the cause.")) from error


def exit_with_parent() -> None:
    """Have the kernel kill this process when its parent (the launching process) dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def delay_observer_kill(grace_s: float) -> None:
    """Let rank 0 say which stage failed before Lightning's process observer ends the run.

    Lightning's popen launcher polls the stage processes every 5 s from a thread that, once one has
    exited with an error (e.g. SIGKILLed by the OOM killer), SIGKILLs all of them and this process,
    which then dies before its own report of the failed stage (the error the user should see). The
    stages detect a lost neighbour at once and rank 0 exits by itself, so the observer (a private
    Lightning class, found by its thread name) waits ``grace_s`` first: it is left the backstop for
    a process that hangs.
    """

    def delay(terminate: Callable[[], None]) -> Callable[[], None]:
        def delayed() -> None:
            time.sleep(grace_s)  # a daemon thread: it ends with this process if rank 0 exits first
            terminate()

        return delayed

    lightning.wrap_process_observers(delay)


def wait_for_exit(children: Sequence[subprocess.Popen[bytes]], grace_s: float) -> list[subprocess.Popen[bytes]]:
    """Wait up to ``grace_s`` in all for ``children`` to exit; return those still running."""
    deadline = time.monotonic() + grace_s
    running = []
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(child)
    return running


def reap(children: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """At the launching process's exit: give the stage processes ``grace_s`` to finish, then kill them
    (a stopped or hung one included), so none outlives the run."""
    for child in wait_for_exit(children, grace_s):
        child.kill()  # SIGKILL also ends a stopped process
        child.wait()
