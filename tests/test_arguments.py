"""Every NASPipeStrategy argument is checked when the strategy is constructed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import lightning_naspipe as lnp

BAD = [
    ({"window": 0}, "window=0"), ({"window": 2.5}, "window=2.5"), ({"window": True}, "window=True"),
    ({"chunks": "4"}, "chunks='4'"), ({"num_stages": 0}, "num_stages=0"),
    ({"num_stages": "automatic"}, "num_stages='automatic'.*'auto'"),
    ({"balance": [3, 0]}, r"balance=\[3, 0\]"), ({"balance": []}, r"balance=\[\]"), ({"balance": "32"}, "balance='32'"),
    ({"schedule": "1f1b"}, "schedule='1f1b'.*'csp'"), ({"rebalance_every": 0}, "rebalance_every=0"),
    ({"offload": "yes"}, "offload='yes'.*True or False"), ({"offload_budget_bytes": -1}, "offload_budget_bytes=-1"),
    ({"telemetry": 1}, "telemetry=1"), ({"trace_dir": 3}, "trace_dir=3.*path"),
    ({"timeout": "20s"}, "timeout='20s'.*seconds"), ({"timeout": 0}, "timeout=0.*positive"),
    ({"process_group_backend": "NCCL"}, "process_group_backend='NCCL'.*'nccl'"),
    ({"start_method": "thread"}, "start_method='thread'.*'popen'"),
    ({"transport": "tcp"}, "transport='tcp'.*'shared_memory'"),
    ({"defer_weight_grads": "auto"}, "defer_weight_grads='auto'.*True or False, or None"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[f"{k}={v!r}" for kw, _ in BAD for k, v in kw.items()])
def test_bad_argument_is_refused_naming_it(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=f"NASPipeStrategy\\({message}"):
        lnp.NASPipeStrategy(**kwargs)


def test_timeout_in_seconds_and_good_arguments_are_kept() -> None:
    strategy = lnp.NASPipeStrategy(window=3, chunks=2, num_stages=2, balance=(2, 3), schedule="gpipe", timeout=20,
                                   offload=True, offload_budget_bytes=2**20, trace_dir="traces", start_method="spawn")
    assert strategy.timeout == timedelta(seconds=20)
    assert strategy.balance == [2, 3] and strategy.rebalance_every is None  # an explicit balance is kept
    assert (strategy.window, strategy.chunks, strategy.schedule, strategy.telemetry) == (3, 2, "gpipe", True)
    assert lnp.NASPipeStrategy(timeout=timedelta(minutes=1)).timeout == timedelta(minutes=1)
    assert lnp.NASPipeStrategy().defer_weight_grads is None
    assert lnp.NASPipeStrategy(defer_weight_grads=False).defer_weight_grads is False
    assert lnp.NASPipeStrategy(num_stages="auto").num_stages == "auto"
