import logging
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_quiet() -> None:
    # Several test processes share 2 cores; one thread each keeps timings sane.
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _own_start_up_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs (and the processes tests start, which inherit the environment) measure afresh and never write to the
    # user's ~/.cache: each test has a start-up cache folder of its own.
    monkeypatch.setenv("LIGHTNING_NASPIPE_CACHE", str(tmp_path_factory.mktemp("naspipe_cache")))
