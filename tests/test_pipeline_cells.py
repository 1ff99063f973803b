"""The NB201 cell space on 2 and 3 stage processes, cuts inside cells: bitwise the plain Trainer.

Node states travel between a cell's blocks as one tuple, ``skip`` edges pass tensors on that are
also used before the cut, and the labels are shared by both cells: what broke 0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from helpers import assert_same_state, load_example, nb201_trainer_kwargs
from test_pipeline import run_ranks, torchrun_env

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("nb201_run.py")


def _checkpoint_state(path: Path) -> dict[str, Any]:
    raw = torch.load(path, weights_only=False)
    return {"model": raw["state_dict"], "optimizer": raw["optimizer_states"][0], "losses": {},
            "global_step": raw["global_step"]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    example = load_example("nb201_digits")
    pl.seed_everything(42, verbose=False)
    model = example.NB201Supernet(channels=4)
    trainer = pl.Trainer(**nb201_trainer_kwargs())
    trainer.fit(model, example.DigitsDataModule(batch_size=32))
    path = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    trainer.save_checkpoint(path)
    return _checkpoint_state(path)


# 19 blocks: stem 0, cell one 1-8, reduction 9, cell two 10-17, head 18.
# Window 1 (no two subnets in flight) on 2 stages, window 8 (CSP's conflicts) on 3: each cut and window also
# runs in tests/test_boundary.py's properties, in-process.
@pytest.mark.parametrize("balance, window", [([5, 14], 1), ([4, 9, 6], 8)])
def test_nb201_cut_inside_cells_equals_plain_trainer(tmp_path: Path, plain: dict, balance: list[int],
                                                     window: int) -> None:
    out = tmp_path / "run.ckpt"
    run_ranks(tmp_path, SCRIPT, ["--out", str(out), "--devices", str(len(balance)), "--window", str(window),
                                 "--balance", *map(str, balance)], torchrun_env(len(balance)))
    got = _checkpoint_state(out)
    assert got["global_step"] == 64
    assert_same_state(plain, got)
