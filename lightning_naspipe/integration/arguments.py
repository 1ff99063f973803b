"""``NASPipeStrategy``'s constructor arguments, checked when it is constructed.

A wrong type or value fails here with a message naming the argument, what it means and an example,
not later inside torch or in a stage process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.schedule.schedules import SCHEDULES
from lightning_naspipe.transport.link import TRANSPORTS

START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl", "mpi")


def _refuse(name: str, value: object, meaning: str) -> NASPipeConfigError:
    return NASPipeConfigError(f"NASPipeStrategy({name}={value!r}) is invalid: {name} is {meaning}.")


def positive_int(name: str, value: object, meaning: str, optional: bool = False) -> None:
    """``value`` is an int >= 1 (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(name, value, f"{meaning} (an int >= 1{', or None' if optional else ''})")


def flag(name: str, value: object, meaning: str, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise _refuse(name, value, f"{meaning} (True or False{', or None' if optional else ''})")


def choice(name: str, value: object, choices: Sequence[str | None], meaning: str) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise _refuse(name, value, f"{meaning}; choose one of {shown}")


def balance(value: object) -> list[int] | None:
    """The blocks-per-stage list, or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value):
        raise _refuse("balance", value, "the number of blocks on each stage, e.g. [3, 2, 4] (ints >= 1), or None")
    return list(value)


def timeout(value: object) -> timedelta:
    """A ``timedelta``; a number is taken as seconds."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise _refuse("timeout", value, "how long a stage waits for a neighbour, e.g. timedelta(minutes=3) or 180 "
                                        "(seconds)")
    if seconds <= 0:
        raise _refuse("timeout", value, "how long a stage waits for a neighbour; it must be positive")
    return timedelta(seconds=seconds)


def folder(name: str, value: object, meaning: str) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise _refuse(name, value, f"{meaning} (a path, or None)")


def check_all(arguments: dict[str, Any]) -> dict[str, Any]:
    """Check every argument of ``NASPipeStrategy.__init__`` (but the Trainer's plugins); the normalized values."""
    positive_int("window", arguments["window"], "the number of subnets per Lightning batch, e.g. window=8")
    positive_int("chunks", arguments["chunks"], "the number of micro-batches per subnet; None (the default) follows "
                 "the module's chunks", optional=True)
    if arguments["num_stages"] != "auto":
        positive_int("num_stages", arguments["num_stages"],
                     "the number of pipeline stages, None for one per process, or 'auto'", optional=True)
    positive_int("rebalance_every", arguments["rebalance_every"],
                 "how many windows pass between rebalancing checks, None to keep the split fixed", optional=True)
    positive_int("offload_budget_bytes", arguments["offload_budget_bytes"],
                 "a cap on each stage's device-resident bytes with offload, e.g. 2**30", optional=True)
    choice("schedule", arguments["schedule"], list(SCHEDULES), "the pipeline schedule")
    for name, meaning in (("offload", "whether blocks live in host memory between uses"),
                          ("telemetry", "whether per-stage busy and wait times are logged"),
                          ("lookahead", "whether the next window's forwards may run in this window's drain")):
        flag(name, arguments[name], meaning)
    flag("defer_weight_grads", arguments["defer_weight_grads"],
         "whether weight gradients wait until input gradients are sent (None: measured)", optional=True)
    folder("trace_dir", arguments["trace_dir"], "where the Chrome trace and timeline are written")
    choice("process_group_backend", arguments["process_group_backend"], [None, *BACKENDS],
           "the torch.distributed backend (None: gloo on CPU, NCCL on CUDA)")
    choice("transport", arguments["transport"], list(TRANSPORTS), "how activations and gradients travel between stages")
    choice("start_method", arguments["start_method"], list(START_METHODS), "how the stage processes start")
    return {"balance": balance(arguments["balance"]), "timeout": timeout(arguments["timeout"])}
