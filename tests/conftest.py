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
