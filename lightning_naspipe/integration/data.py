"""Windows of batches, and exact mid-epoch resume of the data order.

One Lightning batch is a *window*: a list of ``window`` consecutive batches of the user's
dataloader, one per subnet. The batch sequence is the user's own, so it is the one a plain
one-device run sees.

Exact resume: a shuffling ``DataLoader`` draws its permutation from torch's global RNG, or from
the ``generator`` it was given, when it starts an epoch, and Lightning cannot replay that on
resume. :class:`DataTracker` records the state of the CPU RNG and of every generator that drives
the loader's order (:func:`order_generators`) at the start of each epoch and, in the checkpoint,
how many batches of the epoch were trained and how many were read. On resume it restores those
states, re-creates the same permutation, reads as many batches as the run had read (keeping the
untrained ones), and then restores them to checkpoint time: whatever a loader draws lazily (a
``RandomSampler`` draws at its first batch) is drawn as it was. A checkpoint written after the
epoch's last window but before the epoch ended (``every_n_train_steps`` at the epoch's length)
resumes with no batches left in that epoch.

The loader starts an epoch's iterator when Lightning calls ``iter`` on it (a configuration error is
raised from the first batch instead, so that Lightning's own ``iter`` call does not fail).

The window loader never reads past a sized loader's last batch, as plain Lightning does not:
a ``RandomSampler`` with a generator draws its next permutation when read past its end.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.namespaces import overrides_hook


class DataTracker:
    """Tracks where training stands in the current epoch's batch sequence.

    Args:
        trainer: returns the running ``pl.Trainer``.
    """

    def __init__(self, trainer: Callable[[], Any]) -> None:
        self._trainer = trainer
        self._epoch = 0
        self._epoch_rng: torch.Tensor | None = None
        self._epoch_start_step = 0
        self._yielded = 0  # batches handed to Lightning this epoch (skipped ones included)
        self._read = 0  # batches read from this epoch's iterator (skipped ones and read-ahead included)
        self._started: tuple[int, int] | None = None  # (epoch, global step) where an epoch iterator last started
        self._trained: tuple[torch.Tensor, list[torch.Tensor], int] | None = None  # see window_trained
        self._windows = 0
        self._exhausted = False
        self._resume: dict[str, Any] | None = None
        self.epoch_length: int | float = math.inf  # batches in this epoch, if the dataloader is sized
        self._generators: list[torch.Generator] = []
        self._epoch_generator_states: list[torch.Tensor] = []

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this epoch exactly."""
        trainer = self._trainer()
        position = self.position()
        done = self._exhausted or self._windows >= trainer.num_training_batches
        finished = done and position >= self._yielded
        # A run resumed inside the epoch goes on from its last trained window: the RNGs as they were there,
        # not after what came since (e.g. the validation Lightning runs when max_steps stops a fit).
        rng, generators, read = (self._now() if finished or self._trained is None else self._trained)
        return {
            "epoch": self._epoch,
            "epoch_rng": self._epoch_rng,
            "rng": rng,
            "epoch_generators": self._epoch_generator_states,
            "generators": generators,
            "position": position,
            "read": read,
            "finished": finished,
        }

    def window_trained(self) -> None:
        """A window of this epoch was trained: where a run resumed inside the epoch goes on from."""
        self._trained = self._now()

    def _now(self) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        return torch.get_rng_state(), [g.get_state() for g in self._generators], self._read

    def position(self) -> int:
        """Subnets trained in this epoch so far (a resumed run's included)."""
        return int(self._trainer().global_step - self._epoch_start_step)

    def next_index(self) -> int:
        """The index of the next subnet to be handed out (windows handed out but not yet trained included)."""
        return self._epoch_start_step + self._yielded

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Arrange for the next epoch start to continue from ``state``."""
        self._resume = dict(state)

    def start_epoch(self, length: int | float = math.inf, generators: list[torch.Generator] | None = None,
                    drop_iterator: Callable[[], object] = lambda: None) -> tuple[int, int] | None:
        """Called as an epoch's iterator starts, with the dataloader's length and :func:`order_generators`.

        Lightning starts the iterator of an epoch whose loader it reloads twice, and reads the first window
        of the first (it prefetches from a loader without length) where a plain run only makes a first
        iterator and reads nothing from it. The second start therefore goes back to the RNG states of the
        first and calls ``drop_iterator`` (make an iterator of the user's loader and drop it), so the
        iterator that trains draws what the plain run's does.

        Returns:
            ``(skip, read)``: skip the first ``skip`` batches and read up to ``read`` in all before
            :meth:`skipped`; ``None`` when the resumed epoch has no batches left (its last window was
            trained before the checkpoint), so the epoch ends without reading.
        """
        trainer = self._trainer()
        self.epoch_length = length
        self._generators = list(generators or [])
        resume, self._resume = self._resume, None
        again, self._started = self._started == (trainer.current_epoch, trainer.global_step), (
            trainer.current_epoch, trainer.global_step)
        self._yielded, self._windows, self._exhausted, self._read = 0, 0, False, 0
        self._epoch = trainer.current_epoch
        self._after_skip: dict[str, Any] | None = None
        if resume is not None:
            saved = resume.get("generators", [])  # absent in checkpoints of 0.1
            if len(saved) != len(self._generators):
                raise NASPipeConfigError(
                    f"The checkpoint's training data order was driven by {len(saved)} seeded torch.Generator(s) "
                    f"(DataLoader(generator=...) or a sampler's), this dataloader's by {len(self._generators)}; "
                    "resume with the same dataloader setup to continue the data order exactly."
                )
        if resume is not None and not resume["finished"] and resume["epoch_rng"] is not None:
            self._set_states(resume["epoch_rng"], resume.get("epoch_generators", []))
            self._epoch_rng, self._epoch_generator_states = resume["epoch_rng"], resume.get("epoch_generators", [])
            self._epoch_start_step = trainer.global_step - resume["position"]
            self._after_skip = resume
            return int(resume["position"]), int(resume.get("read", resume["position"]))  # "read": since 0.2
        if resume is not None:
            self._set_states(resume["rng"], resume.get("generators", []))
            if resume.get("epoch_open"):  # Lightning goes on with the epoch, whose data is spent
                self._epoch_rng, self._epoch_generator_states = resume["epoch_rng"], resume.get("epoch_generators", [])
                self._epoch_start_step = trainer.global_step - resume["position"]
                self._yielded, self._exhausted = int(resume["position"]), True
                return None
        elif again and self._epoch_rng is not None:
            self._set_states(self._epoch_rng, self._epoch_generator_states)
            drop_iterator()
        self._epoch_rng = torch.get_rng_state()
        self._epoch_generator_states = [g.get_state() for g in self._generators]
        self._epoch_start_step = trainer.global_step
        return 0, 0

    def _set_states(self, rng: torch.Tensor, generator_states: list[torch.Tensor]) -> None:
        torch.set_rng_state(rng)
        for generator, state in zip(self._generators, generator_states):
            generator.set_state(state)

    def skipped(self, count: int) -> None:
        """The first ``count`` batches were skipped; put the RNGs where the checkpoint left them."""
        self._yielded = count
        if self._after_skip is not None:
            self._set_states(self._after_skip["rng"], self._after_skip.get("generators", []))
            self._after_skip = None
        self.window_trained()  # (none yet this epoch: its start)

    def end_epoch_at(self, position: int) -> None:
        """The epoch ends after its first ``position`` subnets (``on_train_batch_start`` returned -1)."""
        self._yielded, self._exhausted = position, True

    def read(self) -> None:
        """One more batch was read from this epoch's iterator."""
        self._read += 1

    def yielded(self, count: int, exhausted: bool) -> None:
        self._yielded += count
        self._windows += 1 if count else 0
        self._exhausted = exhausted


class WindowLoader:
    """Wraps a training dataloader so that each item is a list of ``window`` batches.

    Args:
        dataloader: the user's (already Lightning-processed) training dataloader.
        window: subnets per Lightning batch.
        tracker: records the epoch position for exact resume.
        step_triggers: every this many subnets something must see the run between two windows
            (``ModelCheckpoint(every_n_train_steps=...)``): a window ends early rather than cross a
            multiple, so the trigger fires at the subnet count the user asked for. Results never depend
            on where windows end.
        batch_limit: batches of the user's loader per epoch at most (``limit_train_batches`` and
            ``overfit_batches`` in batches, see :func:`train_batch_limit`).
    """

    def __init__(self, dataloader: Iterable[Any], window: int, tracker: DataTracker,
                 step_triggers: Iterable[int] = (), batch_limit: int | float = math.inf) -> None:
        self.dataloader = dataloader
        self.batch_limit = batch_limit
        self.window = window
        self.tracker = tracker
        self.step_triggers = sorted(set(step_triggers))
        #: The windows of this epoch handed out last (Lightning fetches one ahead), by first subnet index.
        self.handed_out: dict[int, list[Any]] = {}
        #: Whether :meth:`read_ahead` may read: only from a loader that reads in this process (no workers),
        #: where a read is this process's own work and never blocks on another's.
        self.reads_ahead = getattr(dataloader, "num_workers", 0) == 0
        #: Batches :meth:`read_ahead` has read this fit.
        self.read_ahead_count = 0
        self._source: Iterator[Any] | None = None  # this epoch's iterator of the user's loader
        self._unread: int | float = 0  # batches this epoch's iterator may still be read for
        self._ahead: deque[Any] = deque()  # batches read ahead, in order, not yet in a window
        self._failure: Exception | None = None  # what the user's loader raised when read ahead

    # No ``__len__`` on purpose: Lightning then ends an epoch when the data runs out rather than
    # after a count of windows, which a resumed run (partial first window, another window size)
    # would get wrong. The progress bar takes its total from the tracker (progress.py).

    def __getattr__(self, name: str) -> Any:
        # Lightning and users read attributes such as ``sampler`` or ``batch_size``.
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[list[Any]]:
        try:
            return self._start()
        except NASPipeConfigError as error:  # raised from the first batch: Lightning's iter() must not fail
            return _raising(error)

    def _start(self) -> Iterator[list[Any]]:
        length = min(_length(self.dataloader), self.batch_limit)
        start = self.tracker.start_epoch(length, order_generators(self.dataloader), lambda: iter(self.dataloader))
        self.handed_out = {}
        if start is None:  # a resumed epoch whose last window was trained: it ends without reading
            self._source, self._unread, self._ahead = None, 0, deque()
            return iter(())
        skip, read = start
        iterator = iter(self.dataloader)
        self._source, self._unread, self._ahead, self._failure = iterator, length, deque(), None
        for _ in range(max(skip, read)):
            if not self._read_one():
                break
        if len(self._ahead) < skip:
            raise NASPipeConfigError(
                f"Resuming expects at least {skip} training batches in this epoch but the dataloader yields only "
                f"{len(self._ahead)}; resume with the same data, batch size and dataset as the checkpointed run."
            )
        for _ in range(skip):
            self._ahead.popleft()
        self.tracker.skipped(skip)
        return self._windows(iterator)

    def _windows(self, iterator: Iterator[Any]) -> Iterator[list[Any]]:
        try:
            while True:
                # Never past a sized loader's end (see the module docstring).
                size = min(self.window, len(self._ahead) + self._unread,
                           *(n - self.tracker.next_index() % n for n in self.step_triggers))
                batches = self._take(int(size))
                exhausted = len(batches) < size or (not self._ahead and self._unread <= 0)
                if exhausted and not batches:
                    self.tracker.yielded(0, True)
                    return
                first = self.tracker.next_index()
                self.handed_out = dict([*list(self.handed_out.items())[-1:], (first, batches)])
                self.tracker.yielded(len(batches), exhausted)
                yield batches
                if exhausted:
                    return
        finally:  # (also when a new epoch's iterator replaced this one: then leave that one's alone)
            if self._source is iterator:
                self._source = None

    def read_ahead(self) -> bool:
        """Read the next batch of this epoch from the user's dataloader now, for a window to come.

        A stage calls it while it waits for a message (see :mod:`.transport`): every stage reads every
        batch, and read there, the reading overlaps the wait instead of adding to the stage's time
        between windows. Batches come out of the same iterator in the same order, so windows are the
        same. At most one window is read ahead, and never past a sized loader's end. An error of the
        user's loader is kept and raised where a run without reading ahead meets it (the read for the
        window that needs the batch), never in the middle of a window.

        Returns:
            Whether a batch was read (``False``: nothing to read now, or ``reads_ahead`` is off).
        """
        if (self._source is None or not self.reads_ahead or len(self._ahead) >= self.window or self._unread <= 0
                or self._failure is not None):
            return False
        try:
            if not self._read_one():
                return False
        except Exception as error:  # noqa: BLE001  # the user's loader; raised again by _read_one
            self._failure = error
            return False
        self.read_ahead_count += 1
        return True

    def _take(self, size: int) -> list[Any]:
        """The next ``size`` batches: those read ahead first, then from the iterator (fewer at its end)."""
        batches = [self._ahead.popleft() for _ in range(min(size, len(self._ahead)))]
        while len(batches) < size and self._read_one():
            batches.append(self._ahead.pop())
        return batches

    def _read_one(self) -> bool:
        assert self._source is not None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        try:
            self._ahead.append(next(self._source))
        except StopIteration:
            self._unread = 0
            return False
        self._unread -= 1
        self.tracker.read()
        return True


def order_generators(dataloader: object) -> list[torch.Generator]:
    """The seeded generators that drive ``dataloader``'s order: its own (it draws the worker base seed
    from it) and its sampler's or batch sampler's, each once.

    Raises:
        NASPipeConfigError: a sampler's ``generator`` is not a ``torch.Generator``, whose state could not be
            saved for exact resume.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    holders = (dataloader, getattr(dataloader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found: dict[int, torch.Generator] = {}
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if generator is None:
            continue
        if not isinstance(generator, torch.Generator):
            raise NASPipeConfigError(
                f"The training dataloader's {type(holder).__name__}.generator is a {type(generator).__name__}; NASPipe "
                "saves the state of the generators that drive the data order to resume it exactly, and can only do "
                "that for a torch.Generator. Use torch.Generator().manual_seed(...) instead."
            )
        found[id(generator)] = generator
    return list(found.values())


def _raising(error: Exception) -> Iterator[Any]:
    raise error
    yield  # a generator: raises at its first item


def train_batch_limit(limit: int | float, dataloader: Iterable[Any]) -> int | float:
    """``Trainer(limit_train_batches=limit)`` (which ``overfit_batches`` sets too) as the batches of the
    user's training ``dataloader`` that a plain run trains per epoch, by Lightning's rule.

    Raises:
        NASPipeConfigError: a fraction of a loader without a length, or a fraction that leaves no batch.
    """
    length = _length(dataloader)
    if isinstance(limit, int):
        return min(length, limit)
    if limit == 1.0:
        return length
    if math.isinf(length):
        raise NASPipeConfigError(
            f"Trainer(limit_train_batches={limit}) asks for a fraction of the training dataloader, which has no "
            "length (an IterableDataset); give a number of batches instead, e.g. limit_train_batches=100."
        )
    if int(length * limit) == 0 and limit > 0:
        raise NASPipeConfigError(
            f"Trainer(limit_train_batches={limit}) of the {length} training batches is less than one batch; "
            f"use at least limit_train_batches={1 / length}."
        )
    return int(length * limit)


def _length(dataloader: Iterable[Any]) -> int | float:
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except TypeError:  # no __len__, or an IterableDataset without one
        return math.inf


def refuse_distributed_sampler(dataloader: object) -> None:
    """Every stage must see the same batches: a ``DistributedSampler`` (one shard per rank) is an error."""
    from torch.utils.data import DistributedSampler

    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if isinstance(sampler, DistributedSampler) or isinstance(getattr(batch_sampler, "sampler", None),
                                                             DistributedSampler):
        raise NASPipeConfigError(
            "The dataloader uses a DistributedSampler, which gives each stage different data; every NASPipe "
            "stage must see the same batches. Use a normal sampler (e.g. DataLoader(..., shuffle=True))."
        )


#: Lightning's hooks between a dataloader's batch and ``training_step``.
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def transfer_hooks_overridden(trainer: Any, module: Any) -> bool:
    """Whether the module or the trainer's datamodule overrides one of :data:`TRANSFER_HOOKS`: running it
    on a batch early (lookahead) and again when Lightning hands the batch over could differ (augmentation)."""
    owners = [owner for owner in (module, getattr(trainer, "datamodule", None)) if owner is not None]
    return any(overrides_hook(owner, hook, ("DataHooks", "LightningModule", "LightningDataModule"))
               for owner in owners for hook in TRANSFER_HOOKS)
