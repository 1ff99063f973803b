"""The search log: JSON lines, one record per evaluation, under a header naming what the scores depend on.

A resumed search reuses the logged scores, so a log written for other weights, other evaluation or
calibration batches or another searcher would silently give wrong results. The header holds a
:func:`fingerprint` of all of those; a log whose fingerprint differs is refused. Each record's write
ends with its newline and an fsync, so a killed search leaves whole records and at most one cut
line, which the resumed search cuts off.

A search under measured latency also logs every measurement it takes, as it takes it (``{"measured_latency_ms": ms,
"architecture": {...}}`` lines, architectures rejected by a latency range included), and so does a search under a
table and a latency budget for the best architectures it checks end to end before returning one: a measurement is
noisy, so a resumed search reads them back (:func:`read_measurements`) rather than measuring again, and decides as
the interrupted one did.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_naspipe.space.boundary import tensors_in
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.searchers import Record

__all__ = ["append_log", "append_measurement", "fingerprint", "read_log", "read_measurements"]

#: The header line's key: what marks a file as a search log.
HEADER = "lightning_naspipe_search_log"
#: A measurement line's key.
MEASUREMENT = "measured_latency_ms"


def fingerprint(supernet: nn.Module, batches: Sequence[Any], calibration: Sequence[Any], searcher: object,
                max_params: int | None, max_flops: int | None, constraint: Callable[..., Any] | None,
                metric: bool, extra: Any = None) -> str:
    """A hash of everything a search's scores depend on besides the architectures themselves.

    The supernet's parameters and buffers (names, dtypes, shapes and bytes), the evaluation and
    calibration batches, the searcher (its ``repr``: type and settings), the constraints (a
    constraint function by its qualified name), whether a ``search_metric`` scores, and ``extra`` (e.g.
    :meth:`Constraints.settings <.constraints.Constraints.settings>`; ``None`` leaves the hash as it was before
    there were such settings, so older logs still resume).
    """
    digest = hashlib.sha256()
    settings = [repr(searcher), max_params, max_flops, getattr(constraint, "__qualname__", repr(constraint)), metric]
    if extra is not None:
        settings.append(extra)
    digest.update(json.dumps(settings, default=str).encode())
    named = [(name, t) for name, t in supernet.state_dict(keep_vars=False).items()]
    named += [(f"batch{i}", t) for i, b in enumerate(batches) for t in tensors_in(b)]
    named += [(f"calibration{i}", t) for i, b in enumerate(calibration) for t in tensors_in(b)]
    for name, tensor in named:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")  # any dtype, as bytes
    return digest.hexdigest()


def read_log(path: str | os.PathLike[str], expected: str | None = None, repair: bool = False) -> list[Record]:
    """The records of a search log.

    Args:
        path: the log.
        expected: the search's :func:`fingerprint`; a log with another one is refused.
        repair: cut a last line cut short by a kill off the file, so that appending goes on from the
            last whole record (it is ignored either way).

    Raises:
        NASPipeConfigError: the file is not a search log, or one written for another search.
    """
    file = Path(path)
    if not file.exists():
        return []
    data = file.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]  # each write ends with its newline
    if repair and len(whole) < len(data):
        os.truncate(file, len(whole))
    records = []
    for n, line in enumerate(whole.splitlines(), 1):
        try:
            fields = json.loads(line)
        except ValueError as error:
            raise _not_a_log(path, n, error) from error
        if n == 1 and isinstance(fields, dict) and HEADER in fields:
            if expected is not None and fields.get("fingerprint") != expected:
                raise NASPipeConfigError(
                    f"Search log {path} was written for other weights, evaluation or calibration batches, "
                    "searcher settings or constraints than this search's: its scores do not apply. Pass "
                    "another log_path (one per checkpoint and search), or delete the log.")
            continue
        if _is_measurement(fields):
            continue  # read_measurements
        try:
            records.append(Record(**fields))
        except TypeError as error:
            raise _not_a_log(path, n, error) from error
    return records


def append_log(path: str | os.PathLike[str], records: Sequence[Record], key: str | None = None) -> None:
    """Append ``records`` to a search log and make them durable; a new log starts with the header for ``key``."""
    if not records:
        return
    file = Path(path)
    with open(file, "a") as out:
        if key is not None and out.tell() == 0:
            out.write(json.dumps({HEADER: 1, "fingerprint": key}) + "\n")
        for record in records:
            out.write(json.dumps(_fields(record)) + "\n")  # repr-exact floats
        out.flush()
        os.fsync(out.fileno())


def read_measurements(path: str | os.PathLike[str]) -> list[tuple[dict[str, int], float]]:
    """Every latency measurement a search logged, in order: ``(architecture, ms)`` (whole lines only; call
    :func:`read_log` first, which checks the fingerprint)."""
    file = Path(path)
    if not file.exists():
        return []
    data = file.read_bytes()
    found = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        fields = json.loads(line)
        if _is_measurement(fields):
            found.append((dict(fields["architecture"]), float(fields[MEASUREMENT])))
    return found


def append_measurement(path: str | os.PathLike[str], architecture: dict[str, int], ms: float,
                       key: str | None = None) -> None:
    """Append one latency measurement and make it durable before anything is decided on it."""
    with open(path, "a") as out:
        if key is not None and out.tell() == 0:
            out.write(json.dumps({HEADER: 1, "fingerprint": key}) + "\n")
        out.write(json.dumps({MEASUREMENT: ms, "architecture": architecture}) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _fields(record: Record) -> dict[str, Any]:
    """A record's line: its fields, but the winner check's where unset (as every record is when logged), so a log
    reads as before they existed and a measurement line stays the only one with ``measured_latency_ms``."""
    fields = asdict(record)
    for name, unset in ((MEASUREMENT, None), ("over_budget", False)):
        if fields[name] == unset:
            del fields[name]
    return fields


def _is_measurement(fields: Any) -> bool:
    """Whether a log line is a measurement (a record has an ``index``, and since records gained
    ``measured_latency_ms`` the key alone does not tell)."""
    return isinstance(fields, dict) and MEASUREMENT in fields and "index" not in fields


def _not_a_log(path: str | os.PathLike[str], line: int, error: Exception) -> NASPipeConfigError:
    return NASPipeConfigError(f"Search log {path} line {line} is not a record ({error}); it is not a log "
                              "lnp.search wrote, or it was edited. Pass another log_path.")
