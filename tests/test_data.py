from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_naspipe.integration.data import (
    DataTracker,
    WindowLoader,
    order_generators,
    transfer_hooks_overridden,
)
from lightning_naspipe.errors import NASPipeConfigError


def _trainer(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, current_epoch=0, num_training_batches=float("inf"))


def test_windows_group_consecutive_batches() -> None:
    loader = DataLoader(list(range(10)), batch_size=2)
    trainer = _trainer()
    windows = list(WindowLoader(loader, 3, DataTracker(lambda: trainer)))
    assert [[b.tolist() for b in w] for w in windows] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]


def test_resume_replays_the_shuffle_and_skips_trained_batches() -> None:
    loader = DataLoader(list(range(12)), batch_size=1, shuffle=True)
    trainer = _trainer()
    tracker = DataTracker(lambda: trainer)
    torch.manual_seed(0)
    iterator = iter(WindowLoader(loader, 2, tracker))
    first = [next(iterator), next(iterator)]
    trainer.global_step = 3  # e.g. max_steps stopped inside the second window
    tracker.window_trained()
    state = tracker.state_dict()
    assert state["position"] == 3 and not state["finished"]
    rest = [w for w in iterator]
    expected = [b.item() for w in first + rest for b in w]
    after = torch.rand(1)

    torch.manual_seed(99)  # a fresh process: another RNG state
    resumed_trainer = _trainer(step=3)
    resumed = DataTracker(lambda: resumed_trainer)
    resumed.load_state_dict(state)
    got = [b.item() for w in WindowLoader(loader, 4, resumed) for b in w]
    assert got == expected[3:]
    # The RNG continues from where it was at the checkpoint.
    assert torch.equal(torch.rand(1), after)


def test_finished_epoch_resumes_with_a_fresh_epoch() -> None:
    loader = DataLoader(list(range(4)), batch_size=1, shuffle=True)
    trainer = _trainer()
    tracker = DataTracker(lambda: trainer)
    list(WindowLoader(loader, 2, tracker))
    trainer.global_step = 4
    state = tracker.state_dict()
    assert state["finished"]
    next_epoch = [b.item() for w in WindowLoader(loader, 2, tracker) for b in w]

    resumed = DataTracker(lambda: _trainer(step=4))
    resumed.load_state_dict(state)
    torch.manual_seed(1234)
    assert [b.item() for w in WindowLoader(loader, 2, resumed) for b in w] == next_epoch


def _seeded_loader(seed: int = 5, batch_size: int = 8) -> DataLoader:
    from helpers import toy_loader

    dataset = toy_loader().dataset
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def test_window_loader_reads_a_sized_loader_no_further_than_its_end() -> None:
    # A RandomSampler with a generator draws its next permutation when read past its end: plain
    # Lightning never reads past len(loader), so neither may the windows (96 samples / 8 = 12 = 3 x 4).
    plain, windowed = _seeded_loader(), _seeded_loader()
    for _ in range(3):
        batches = iter(plain)  # as Lightning reads a sized loader: len(plain) batches, not to StopIteration
        for _ in range(len(plain)):
            next(batches)
        assert sum(len(w) for w in WindowLoader(windowed, 4, DataTracker(_trainer))) == 12
    assert torch.equal(plain.generator.get_state(), windowed.generator.get_state())


def test_order_generators_finds_each_generator_once_and_refuses_foreign_ones() -> None:
    loader = _seeded_loader()
    assert order_generators(loader) == [loader.generator]  # DataLoader's and RandomSampler's are one
    assert order_generators(DataLoader(list(range(4)))) == []
    loader.sampler.generator = object()
    with pytest.raises(NASPipeConfigError, match="RandomSampler.generator is a object.*torch.Generator"):
        order_generators(loader)


@pytest.mark.parametrize("stop_at", [17, 12], ids=["mid-epoch", "epoch-end"])
def test_seeded_generator_loader_equals_plain_run_also_across_resume(tmp_path: Path, stop_at: int) -> None:
    import lightning_naspipe as lnp
    from helpers import TOY_NETS, assert_same_state, full_state, pl, train, trainer_kwargs

    plain = full_state(*train(loader=_seeded_loader(), max_epochs=3))
    assert_same_state(plain, full_state(*train(lnp.NASPipeStrategy(window=5), loader=_seeded_loader(), max_epochs=3)))

    stopped_model, stopped = train(lnp.NASPipeStrategy(window=5), loader=_seeded_loader(), max_epochs=3,
                                   max_steps=stop_at)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    torch.manual_seed(1234)  # a fresh process: other RNG states, a freshly seeded generator
    model = TOY_NETS[pl]()
    model.losses.update(stopped_model.losses)
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=3), max_epochs=3))
    trainer.fit(model, _seeded_loader(), ckpt_path=tmp_path / "stop.ckpt")
    assert_same_state(plain, full_state(model, trainer))


def test_resume_with_another_generator_setup_is_refused(tmp_path: Path) -> None:
    import lightning_naspipe as lnp
    from helpers import TOY_NETS, pl, toy_loader, train, trainer_kwargs

    _, stopped = train(lnp.NASPipeStrategy(window=5), loader=_seeded_loader(), max_epochs=2, max_steps=7)
    stopped.save_checkpoint(tmp_path / "stop.ckpt")
    trainer = pl.Trainer(**trainer_kwargs(strategy=lnp.NASPipeStrategy(window=5), max_epochs=2))
    with pytest.raises(NASPipeConfigError, match=r"driven by 1 seeded torch.Generator.*by 0"):
        trainer.fit(TOY_NETS[pl](), toy_loader(), ckpt_path=tmp_path / "stop.ckpt")


def test_windows_end_at_step_triggers() -> None:
    loader = DataLoader(list(range(20)), batch_size=1)
    trainer = _trainer(step=3)  # e.g. resumed at subnet 3
    windows = list(WindowLoader(loader, 5, DataTracker(lambda: trainer), step_triggers=[8, 6]))
    ends = list(itertools.accumulate(len(w) for w in windows))
    assert [3 + e for e in ends] == [6, 8, 12, 16, 18, 23]  # never across a multiple of 6 or 8


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_transfer_hooks_overridden_by_the_module_or_the_datamodule(namespace: str) -> None:
    """Lookahead moves the next window's batches to the device early; a batch-transfer hook of the user's
    would run twice on them (augmentation would differ), so any override turns it off."""
    import importlib

    pl = importlib.import_module(namespace)

    class Plain(pl.LightningModule):
        pass

    class Augmenting(pl.LightningModule):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return batch

    class Moving(pl.LightningDataModule):
        def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
            return batch

    bare = SimpleNamespace(datamodule=None)
    assert not transfer_hooks_overridden(bare, Plain())
    assert transfer_hooks_overridden(bare, Augmenting())
    assert not transfer_hooks_overridden(SimpleNamespace(datamodule=pl.LightningDataModule()), Plain())
    assert transfer_hooks_overridden(SimpleNamespace(datamodule=Moving()), Plain())


def test_the_window_loader_keeps_the_last_two_windows_it_handed_out() -> None:
    trainer = _trainer()
    loader = WindowLoader(DataLoader(list(range(10)), batch_size=1), 3, DataTracker(lambda: trainer))
    iterator = iter(loader)
    first, second = next(iterator), next(iterator)
    assert loader.handed_out == {0: first, 3: second}  # Lightning trains window 0 while it holds window 3
    third = next(iterator)
    assert loader.handed_out == {3: second, 6: third}
    trainer.global_step, trainer.current_epoch = 10, 1
    again = iter(loader)  # the next epoch: none of the last one's windows is "next"
    assert next(again)[0].tolist() == [0] and list(loader.handed_out) == [10]


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """An unsized dataset: its epoch ends when it runs out."""

    def __iter__(self) -> Any:
        return iter(range(23))


def _loaders() -> list[tuple[str, Any, list[int]]]:
    return [("shuffled with a generator", _seeded_loader(batch_size=5), []),
            ("list", DataLoader(list(range(30)), batch_size=2), [7]),
            ("unsized stream", DataLoader(_Stream(), batch_size=2), [])]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("seed", range(4))
def test_reading_ahead_at_any_moment_keeps_every_window_and_the_data_order(case: int, seed: int) -> None:
    """Stages call read_ahead while they wait, at moments no one can predict: the windows, the tracker
    and the loader's generator must come out as if nothing had been read early."""
    name, plain_loader, triggers = _loaders()[case]
    _, ahead_loader, _ = _loaders()[case]
    rng = __import__("random").Random(seed)

    def epochs(loader: Any, read_ahead: bool) -> tuple[list[Any], WindowLoader]:
        trainer = _trainer(step=3)
        windows = WindowLoader(loader, 4, DataTracker(lambda: trainer), step_triggers=triggers)
        seen = []
        for epoch in range(2):
            trainer.current_epoch = epoch
            for window in windows:
                trainer.global_step += len(window)
                seen.append([_flat(b) for b in window])
                for _ in range(rng.randrange(7) if read_ahead else 0):
                    windows.read_ahead()
            assert not windows.read_ahead(), "nothing to read between epochs"
        return seen, windows

    plain, _ = epochs(plain_loader, False)
    ahead, windows = epochs(ahead_loader, True)
    assert ahead == plain, name
    assert windows.read_ahead_count > 0
    generator = getattr(plain_loader, "generator", None)
    if generator is not None:  # read no further than the loader's end (see the test above)
        assert torch.equal(generator.get_state(), ahead_loader.generator.get_state())


def _flat(batch: Any) -> Any:
    return [_flat(part) for part in batch] if isinstance(batch, (list, tuple)) else batch.tolist()


def test_reading_ahead_holds_at_most_one_window_and_never_reads_a_loader_with_workers() -> None:
    trainer = _trainer()
    windows = WindowLoader(DataLoader(list(range(20)), batch_size=1), 3, DataTracker(lambda: trainer))
    assert not windows.read_ahead()  # no epoch running
    iterator = iter(windows)
    assert next(iterator)[0].tolist() == [0]
    assert [windows.read_ahead() for _ in range(5)] == [True, True, True, False, False]
    assert [b.tolist() for b in next(iterator)] == [[3], [4], [5]]
    with_workers = WindowLoader(DataLoader(list(range(20)), batch_size=1, num_workers=1), 3,
                                DataTracker(lambda: trainer))
    assert not with_workers.reads_ahead


def test_an_abandoned_epoch_iterator_leaves_the_next_epochs_reading_alone() -> None:
    trainer = _trainer()
    windows = WindowLoader(DataLoader(list(range(20)), batch_size=1), 3, DataTracker(lambda: trainer))
    abandoned = iter(windows)
    next(abandoned)  # an epoch stopped early (limit_train_batches, max_steps)
    current = iter(windows)
    assert next(current)[0].tolist() == [0]
    abandoned.close()  # as the garbage collector closes it
    assert windows.read_ahead()


def test_an_error_of_the_users_loader_read_ahead_is_raised_where_the_window_needs_the_batch() -> None:
    class Failing:
        def __len__(self) -> int:
            return 12

        def __iter__(self) -> Any:
            for item in range(12):
                if item == 5:
                    raise OSError("the disk went away")
                yield torch.tensor([item])

    loader = WindowLoader(Failing(), 4, DataTracker(lambda: _trainer()))  # type: ignore[arg-type]
    windows = iter(loader)
    assert [b.item() for b in next(windows)] == [0, 1, 2, 3]
    # A stage waiting inside this window reads ahead: batch 4, then the failing read, kept for later.
    assert loader.read_ahead() and not loader.read_ahead() and not loader.read_ahead()
    with pytest.raises(OSError, match="the disk went away"):
        next(windows)
