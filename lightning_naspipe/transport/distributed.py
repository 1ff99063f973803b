"""Collectives over all stage processes: objects, block weights and optimizer state.

Each stage trains only its own blocks, so the current copy of a tensor lives on its stage's process.
These helpers bring it where Lightning and the strategy expect it: small objects broadcast or gathered
(timings, busy times, the stage table's rows), every block's weights on every rank (at epoch ends, after
fit and for checkpoints), a moving block's optimizer state handed to its new owner, and the whole
optimizer state in the standard one-optimizer layout on every rank. A window's losses do not pass
here: they travel point to point with its end (:meth:`.p2p.P2PTransport.share_window_end`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer


def broadcast_object(obj: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (default: all)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group, device=device if dist.get_backend() == "nccl" else None)
    return holder[0]


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective when there are several ranks)."""
    if world_size == 1:
        return [obj]
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, obj)
    return parts


def broadcast_tensors_(tensors: Iterable[Tensor], src: int, device: torch.device,
                       bucket_bytes: int = 64 * 2**20) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place.

    Tensors of one dtype travel packed, one broadcast per ``bucket_bytes`` staged on ``device``: a collective's
    fixed cost is paid per call, hundreds of times over for a supernet's small tensors otherwise."""
    buckets: dict[torch.dtype, list[Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    with torch.no_grad():
        for tensor in tensors:
            buckets.setdefault(tensor.dtype, []).append(tensor)
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
            if sizes[tensor.dtype] >= bucket_bytes:
                _broadcast_packed(buckets.pop(tensor.dtype), src, device)
                del sizes[tensor.dtype]
        for bucket in buckets.values():
            _broadcast_packed(bucket, src, device)


def _broadcast_packed(tensors: list[Tensor], src: int, device: torch.device) -> None:
    sending = dist.get_rank() == src
    if sending:
        packed = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
    else:
        packed = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
    dist.broadcast(packed, src=src)
    if not sending:
        for tensor, part in zip(tensors, torch.split(packed, [t.numel() for t in tensors])):
            tensor.copy_(part.view_as(tensor))


def sync_stage_weights(blocks: Sequence[nn.Module], stage_ranges: Sequence[range], ranks: Sequence[int],
                       device: torch.device, only: Collection[int] | None = None) -> int:
    """Give every rank the current parameters and buffers of every block, each tensor from its owner: the stage of
    the first block holding it (a weight tied across stages is stepped there, see :mod:`.ties`).

    Args:
        only: the ids of the tensors that may differ between ranks (all when ``None``); no other is sent.

    Returns:
        How many tensors were sent.
    """
    seen: set[int] = set()
    sent = 0
    for stage, indices in enumerate(stage_ranges):
        tensors = [t for i in indices for t in (*blocks[i].parameters(), *blocks[i].buffers())]
        owned = [t for t in _unique(tensors) if id(t) not in seen]
        seen.update(id(t) for t in owned)
        if only is not None:
            owned = [t for t in owned if id(t) in only]
        broadcast_tensors_(owned, ranks[stage], device)
        sent += len(owned)
    return sent


def hand_over_optimizer_state(optimizer: Optimizer, moving: dict[int, tuple[int, int]], rank: int,
                              world_size: int) -> None:
    """Move optimizer state between ranks: ``moving`` maps ``id(param)`` to ``(old owner, new owner)``.

    The old owner sends the parameter's state (collective), the new owner keeps it on the
    parameter's device (scalar step counters stay where torch keeps them, on the host).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index_of = {id(p): i for i, p in enumerate(params)}
    mine = {index_of[pid]: _to_cpu(optimizer.state[params[index_of[pid]]]) for pid, (old, _) in moving.items()
            if old == rank and pid in index_of and params[index_of[pid]] in optimizer.state}
    for part in gather_objects(mine, world_size):
        for index, state in part.items():
            p = params[index]
            if moving[id(p)][1] == rank:
                optimizer.state[p] = {k: v.to(p.device) if isinstance(v, Tensor) and v.dim() > 0 else v
                                      for k, v in state.items()}
    for pid, (old, new) in moving.items():
        if old == rank and new != rank and pid in index_of:
            optimizer.state.pop(params[index_of[pid]], None)


def gather_optimizer_state(optimizer: Optimizer, owned: set[int], device: torch.device) -> dict[str, Any]:
    """The optimizer's state dict in the standard layout, each parameter's state from its owner.

    Every rank holds the full param groups but steps only the parameters it ``owned`` (ids); every rank receives
    the merged result (collective). What each rank holds is gathered as a small description; the tensors travel
    packed from their owner (:func:`broadcast_tensors_`), not pickled. Received tensors are on the host.
    """
    local = optimizer.state_dict()
    index_of = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    mine = {index_of[pid]: {k: _Described(v.shape, v.dtype) if isinstance(v, Tensor) else v
                            for k, v in local["state"][index_of[pid]].items()}
            for pid in owned if pid in index_of and index_of[pid] in local["state"]}
    rank = dist.get_rank()
    merged: dict[int, dict[str, Any]] = {}
    for src, part in enumerate(gather_objects(mine, dist.get_world_size())):
        fresh = sorted(index for index in part if index not in merged)  # replicas of a stage own alike: the first
        for index in fresh:
            merged[index] = {k: (local["state"][index][k] if src == rank else torch.empty(v.shape, dtype=v.dtype))
                             if isinstance(v, _Described) else v for k, v in part[index].items()}
        broadcast_tensors_([v for index in fresh for v in merged[index].values() if isinstance(v, Tensor)], src,
                           device)
    return {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": local["param_groups"]}


class _Described(NamedTuple):
    """A state tensor as :func:`gather_optimizer_state` describes it to the other ranks."""

    shape: torch.Size
    dtype: torch.dtype


def drop_foreign_state(optimizer: Optimizer, owned: set[int]) -> None:
    """Free optimizer state this stage does not own (e.g. just loaded from a full checkpoint)."""
    for p in list(optimizer.state):
        if id(p) not in owned:
            del optimizer.state[p]


def _unique(tensors: list[Tensor]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}
