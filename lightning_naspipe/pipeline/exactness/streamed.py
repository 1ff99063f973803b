"""The replicas' chained gradient sum, streamed in pieces: the one-device addition order at close to the
cost of a ring all-reduce.

Every element of an update's gradients is summed in the one-device order: replica 0's prefix, then each
later replica's addends in turn (:mod:`.replicas`). Nothing in that order ties one element to another, so
the gradients, laid end to end in one flat buffer per dtype, are cut into :func:`stream_pieces` pieces and
each piece takes the chain on its own: while replica ``r + 1`` adds its addends to piece ``k``, replica ``r``
adds to piece ``k + 1``. Element by element each piece's arithmetic is the whole-buffer one on a slice
(IEEE addition is element-wise), so the sums are bit for bit the unstreamed ones.

The last replica's sums come back the same way, piece by piece, each replica passing piece ``k`` on to the
one before it as it arrives; a replica interleaves the two streams in a fixed order (:func:`_due`), so the
return starts while later pieces still go down and no schedule depends on timing. The cost of one update
on ``D`` replicas, with per-message cost ``a`` and a piece's transfer time ``s / B``, is about
``(P + 2D - 3) (a + S / (P B))``: the pieces' transfer once (``S / B``, as a ring's ``2 S (D-1) / (D B)``
at most), plus a pipeline fill of ``2D - 3`` hops. :func:`stream_pieces` picks ``P`` to balance the two
(:mod:`lightning_naspipe.planning.links` models it against a ring all-reduce).

A broadcast tree would return the sums in ``log D`` hops, but each of its inner nodes sends the whole
gradient several times; the reverse chain sends every byte once per link, so its cost stays flat in ``D``.

Messages, all on the links between neighbouring replicas (FIFO each way)::

    down (r -> r + 1):  presence of each gradient (so far), then piece 0, 1, ..., P - 1
    up   (r + 1 -> r):  the summed piece 0, 1, ..., P - 1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["MIN_PIECE_BYTES", "PIECE_BALANCE_BYTES", "stream_pieces", "streamed_sum"]

#: The message size at which a piece's transfer takes as long as a message's fixed cost (latency times
#: bandwidth: ~0.1 MB on 100 Gb/s Ethernet, ~0.3 MB on 400 Gb/s InfiniBand, ~0.5 MB on NVLink, ~3 MB for a
#: small host's shared-memory links, where a message's wake-up costs a context switch). The cost
#: ``(P + H)(a + S / (P B))`` of ``P`` pieces through ``H`` hops is least at ``P = sqrt(H S / (a B))``; one
#: constant for all links keeps the model within 2x of a ring all-reduce on each (``docs/benchmarks.md``).
PIECE_BALANCE_BYTES = 1 << 20
#: No piece is smaller: below this a message costs its fixed cost whatever its size.
MIN_PIECE_BYTES = 16 << 10


class ChainLinks(Protocol):
    """The messages the stream takes (a :class:`~.replicas.ReplicaGroup`'s)."""

    @property
    def replica(self) -> int: ...

    @property
    def replicas(self) -> int: ...

    def send_next(self, value: Any) -> None: ...

    def recv_previous(self) -> Any: ...

    def send_previous(self, value: Any) -> None: ...

    def recv_next(self) -> Any: ...


def stream_pieces(nbytes: int, replicas: int) -> int:
    """How many pieces an update's ``nbytes`` of gradients are cut into on ``replicas`` replicas: about
    ``sqrt((2D - 3) nbytes / PIECE_BALANCE_BYTES)``, rounded (the pipeline's ``2D - 3`` hops of fill against the
    pieces' fixed costs), at least one and none under :data:`MIN_PIECE_BYTES`."""
    if nbytes <= 0:
        return 0
    hops = max(2 * replicas - 3, 1)
    wanted = round(math.sqrt(hops * nbytes / PIECE_BALANCE_BYTES))
    return max(1, min(wanted, nbytes // MIN_PIECE_BYTES))


def _cuts(templates: Sequence[Tensor], replicas: int) -> list[tuple[int, int, int]]:
    """The pieces as ``(dtype index, start, stop)`` in the flat buffers of :func:`_layout` (the same on every
    replica: ``templates`` are the same parameters everywhere)."""
    sizes = _layout(templates)[1]
    nbytes = sum(n * dtype.itemsize for dtype, n in sizes.items())
    pieces = stream_pieces(nbytes, replicas)
    cuts = []
    for d, (dtype, n) in enumerate(sizes.items()):
        step = max(1, math.ceil(nbytes / max(pieces, 1)) // dtype.itemsize)
        cuts += [(d, start, min(start + step, n)) for start in range(0, n, step)]
    return cuts


def _layout(templates: Sequence[Tensor]) -> tuple[list[tuple[torch.dtype, int]], dict[torch.dtype, int]]:
    """Each template's slot (dtype, start) in the flat buffer of its dtype, and each buffer's length. Every
    parameter has a slot, present or not, so that the pieces are the same all along the chain."""
    slots: list[tuple[torch.dtype, int]] = []
    sizes: dict[torch.dtype, int] = {}
    for t in templates:
        slots.append((t.dtype, sizes.get(t.dtype, 0)))
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    return slots, sizes


def _due(replica: int, replicas: int, down: int) -> int:
    """How many summed pieces a replica passes back once it has sent piece ``down - 1`` down: piece ``j``
    reaches replica ``r`` after ``2 (D - 1 - r)`` more hops than piece ``j`` down, so waiting for it after
    sending piece ``j + 2 (D - 1 - r)`` waits for nothing on links of equal speed."""
    return max(0, down - 2 * (replicas - 1 - replica))


def streamed_sum(links: ChainLinks, addends: Sequence[Sequence[Tensor]], templates: Sequence[Tensor],
                 ) -> list[Tensor | None]:
    """Each parameter's gradient summed along the chain of replicas, on every replica.

    Args:
        links: this replica's links (replica 0 starts the chain, the last one ends it).
        addends: per parameter, this replica's gradients in the one-device order (replica 0: its ``.grad``,
            already the sum of its micro-batches; a later replica: each accumulation's own).
        templates: the parameters, as on every replica.

    Returns:
        Per parameter, ``((prefix + a) + b) ...`` over every replica's addends in order, as one flat
        buffer's views; ``None`` where no replica had one.
    """
    replica, last = links.replica, links.replicas - 1
    slots, sizes = _layout(templates)
    dtypes = list(sizes)
    cuts = _cuts(templates, links.replicas)
    flat = [[a.detach().reshape(-1) for a in own] for own in addends]
    prefix = [False] * len(templates) if replica == 0 else links.recv_previous().tolist()
    present = torch.tensor([before or bool(own) for before, own in zip(prefix, flat)], dtype=torch.bool)
    if replica < last:
        links.send_next(present)
    elif replica > 0:  # the last replica knows which gradients the sum has: every replica needs to
        links.send_previous(present)
    final = present if replica == last else None
    device = templates[0].device if templates else torch.device("cpu")
    summed: list[Tensor] = []

    def back(upto: int) -> None:
        """Take (and pass back) the summed pieces up to ``upto``, the final presence first."""
        nonlocal final
        if final is None and (upto > 0 or upto == len(cuts)):
            final = links.recv_next()
            if replica > 0:
                links.send_previous(final)
        while len(summed) < upto:
            piece = links.recv_next()
            summed.append(piece)
            if replica > 0:
                links.send_previous(piece)

    if replica == 0:  # one copy into flat buffers, then each piece a view: no allocation per piece
        starts = {dtype: torch.cat([own[0] if own else torch.empty(t.numel(), dtype=dtype, device=device)
                                    for own, t in zip(flat, templates) if t.dtype == dtype]) for dtype in dtypes}
    spans = _spans(slots, dtypes, templates, cuts)
    for k, ((d, start, stop), spanned) in enumerate(zip(cuts, spans)):
        piece = starts[dtypes[d]][start:stop] if replica == 0 else links.recv_previous()
        for p, lo, hi in spanned:
            view, offset, began = piece[lo - start:hi - start], slots[p][1], prefix[p]
            # this piece's share of the one-device sum of the parameter, in its order (replica 0's is in place)
            for part in flat[p][1 if replica == 0 else 0:]:
                if began:
                    view.add_(part[lo - offset:hi - offset])
                else:
                    view.copy_(part[lo - offset:hi - offset])
                    began = True
        if replica < last:
            links.send_next(piece)
            back(_due(replica, links.replicas, k + 1))
        else:
            summed.append(piece)
            if replica > 0:
                links.send_previous(piece)
    back(len(cuts))
    assert final is not None
    # Each gradient a view of the piece holding it, or the pieces' slices joined where it straddles some.
    parts: list[list[Tensor]] = [[] for _ in templates]
    for piece, (_, start, _), spanned in zip(summed, cuts, spans):
        for p, lo, hi in spanned:
            parts[p].append(piece[lo - start:hi - start])
    return [None if not here else (parts[p][0] if len(parts[p]) == 1 else
                                   torch.cat(parts[p]) if parts[p] else torch.empty(0, dtype=t.dtype, device=device)
                                   ).view(t.shape)
            for p, (t, here) in enumerate(zip(templates, final.tolist()))]


def _spans(slots: Sequence[tuple[torch.dtype, int]], dtypes: Sequence[torch.dtype], templates: Sequence[Tensor],
           cuts: Sequence[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Per piece, ``(parameter, start, stop)`` of each parameter's elements in it (flat buffer positions): one
    sweep per dtype, as both the slots and the pieces of a dtype come in buffer order."""
    spans: list[list[tuple[int, int, int]]] = [[] for _ in cuts]
    for d, dtype in enumerate(dtypes):
        mine = [(p, offset, offset + t.numel()) for p, ((kind, offset), t) in enumerate(zip(slots, templates))
                if kind == dtype and t.numel()]
        first = 0
        for k, (piece_dtype, start, stop) in enumerate(cuts):
            if piece_dtype != d:
                continue
            while mine[first][2] <= start:
                first += 1
            for p, begin, end in mine[first:]:
                if begin >= stop:
                    break
                spans[k].append((p, max(begin, start), min(end, stop)))
    return spans
