"""Splitting a batch into micro-batches ("chunks") along the first dimension."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_naspipe.errors import NASPipeConfigError


def split_batch(batch: Any, chunks: int) -> list[tuple[Any, float]]:
    """Split every tensor in ``batch`` into ``chunks`` pieces along dim 0.

    Non-tensor leaves are shared by all pieces. With ``chunks == 1`` the batch is returned
    untouched, so the one-chunk path computes on exactly the user's tensors.

    Returns:
        ``(piece, weight)`` pairs, ``weight`` being the piece's share ``n_c / n`` of the samples;
        the subnet's loss is the weighted sum of the pieces' losses.

    Raises:
        NASPipeConfigError: the batch holds no tensor, tensors disagree on their first dimension,
            or it is smaller than ``chunks``.
    """
    if chunks == 1:
        return [(batch, 1.0)]
    sizes: set[int] = set()

    def record(tensor: torch.Tensor) -> torch.Tensor:
        sizes.add(tensor.shape[0] if tensor.dim() else -1)
        return tensor

    apply_to_collection(batch, torch.Tensor, record)
    if not sizes:
        raise NASPipeConfigError(f"chunks={chunks} needs tensors in the batch to split; this batch has none.")
    if len(sizes) != 1 or -1 in sizes:
        raise NASPipeConfigError(
            f"chunks={chunks} splits every tensor of the batch along dim 0, but the batch's tensors have "
            f"first dimensions {sorted(sizes)}; make them equal or use chunks=1."
        )
    size = sizes.pop()
    if size < chunks:
        raise NASPipeConfigError(
            f"A batch of {size} samples cannot be split into chunks={chunks} micro-batches; "
            "use a larger batch_size or fewer chunks."
        )
    pieces = [apply_to_collection(batch, torch.Tensor, lambda t, i=i: t.tensor_split(chunks)[i]) for i in range(chunks)]
    # tensor_split gives the first ``size % chunks`` pieces one extra sample.
    counts = [size // chunks + (1 if i < size % chunks else 0) for i in range(chunks)]
    return [(piece, count / size) for piece, count in zip(pieces, counts)]
