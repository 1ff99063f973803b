"""A weight tied across stages in stage processes (gloo on CPU): the GPT-style space of test_ties.py trains on
3 stage processes, moving a block that reads the tied weight between stages every window, stops mid-epoch with
a checkpoint, and resumes on 2 stages; weights, Adam state, training and validation losses equal the plain
one-device Trainer's bit for bit; and 2 stages x 2 replicas, where the head's contribution to the tied gradient
reaches the owner in every replica's share of the micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_naspipe as lnp
from helpers import assert_same_state, pl, trainer_kwargs
from test_pipeline import run_ranks, torchrun_env
from tied_run import GPTNet, loader

SCRIPT = Path(__file__).with_name("tied_run.py")


def _state(ckpt: Path) -> dict[str, Any]:
    raw = torch.load(ckpt, weights_only=False)
    return {"model": raw["state_dict"], "optimizer": raw["optimizer_states"][0],
            "losses": torch.load(f"{ckpt}.losses", weights_only=False), "global_step": raw["global_step"]}


def _plain(path: Path, **trainer_overrides: Any) -> GPTNet:
    """The plain Trainer's run of GPTNet, its checkpoint and losses saved at ``path``; the trained module."""
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    model = GPTNet()
    trainer = pl.Trainer(**trainer_kwargs(**trainer_overrides))
    trainer.fit(model, loader(), loader(samples=24, shuffle=False))
    trainer.save_checkpoint(path)
    torch.save(model.losses, f"{path}.losses")
    return model


@pytest.mark.slow
def test_tied_embedding_on_three_stages_resumed_on_two_equals_the_plain_trainer(tmp_path: Path) -> None:
    plain_ckpt = tmp_path / "plain.ckpt"
    model = _plain(plain_ckpt)

    stop = tmp_path / "stop.ckpt"
    run_ranks(tmp_path, SCRIPT, ["--out", str(stop), "--devices", "3", "--max-steps", "10", "--move-tied-block"],
              torchrun_env(3))
    assert torch.load(f"{stop}.ranges", weights_only=False) in ([range(0, 3), range(3, 5), range(5, 7)],
                                                                [range(0, 4), range(4, 5), range(5, 7)])
    resumed = tmp_path / "resumed.ckpt"
    run_ranks(tmp_path, SCRIPT, ["--out", str(resumed), "--devices", "2", "--window", "8", "--resume", str(stop)],
              torchrun_env(2))
    ranges = torch.load(f"{resumed}.ranges", weights_only=False)
    assert 0 in ranges[0] and 6 in ranges[1], "the embedding and the head it is tied to are on different stages"
    assert_same_state(_state(plain_ckpt), _state(resumed))
    val = torch.load(f"{resumed}.val_losses", weights_only=False)
    assert val.keys() == model.val_losses.keys() and len(val) == 6  # 3 batches at each of 2 epochs' ends
    assert all(torch.equal(val[key], model.val_losses[key]) for key in val)


@pytest.fixture(scope="module")
def plain_chunks2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    _plain(path, strategy=lnp.NASPipeStrategy(window=4, chunks=2), max_steps=12)
    return _state(path)


@pytest.mark.slow
@pytest.mark.parametrize("devices, stages, balance", [(2, 1, ""), (2, 2, "3,4"), (4, 2, "3,4"), (4, 2, "4,3")])
def test_tied_embedding_with_replicas_and_stages_at_chunks_2_equals_the_plain_trainer(
        tmp_path: Path, plain_chunks2: dict[str, Any], devices: int, stages: int, balance: str) -> None:
    """The tied weight gets one addend per backward call and per contribution a later stage sends: with the mixing
    block on the head's stage (3,4), two contributions ride one message. A later replica adds each addend on its
    own, in order, as one device does (summing a micro-batch's addends first differs in the last bits)."""
    run = tmp_path / "run.ckpt"
    run_ranks(tmp_path, SCRIPT, ["--out", str(run), "--devices", str(devices), "--num-stages", str(stages),
                                 "--chunks", "2", "--max-steps", "12", *(["--balance", balance] if balance else [])],
              torchrun_env(devices))
    if balance:
        ranges = torch.load(f"{run}.ranges", weights_only=False)
        assert [len(r) for r in ranges] == [int(n) for n in balance.split(",")]
    assert_same_state(plain_chunks2, _state(run))
