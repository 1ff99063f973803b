"""Batches and micro-batches: splitting a batch into ``chunks`` along the first dimension, and checking
at fit start that a dataloader's batches split the same way on every stage."""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_naspipe.errors import NASPipeConfigError

#: What the user's dataloader yields for one subnet: a tensor, or any nesting of tuples, lists and dicts of
#: tensors and plain values, split into micro-batches along the first dimension of its tensors. Its
#: structure is the user's, so to the type checker it is ``Any``; the name says what flows.
Batch: TypeAlias = Any


def split_batch(batch: Batch, chunks: int) -> list[tuple[Batch, float]]:
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
    _refuse_per_sample_values(batch, size, chunks)
    if size < chunks:
        raise NASPipeConfigError(
            f"A batch of {size} samples cannot be split into chunks={chunks} micro-batches; "
            "use a larger batch_size or fewer chunks."
        )
    pieces = [apply_to_collection(batch, torch.Tensor, lambda t, i=i: t.tensor_split(chunks)[i]) for i in range(chunks)]
    # tensor_split gives the first ``size % chunks`` pieces one extra sample.
    counts = [size // chunks + (1 if i < size % chunks else 0) for i in range(chunks)]
    return [(piece, count / size) for piece, count in zip(pieces, counts)]


def batch_sizes(dataloader: object) -> set[int]:
    """The batch sizes a plain ``DataLoader`` over a sized dataset yields (empty when it cannot tell)."""
    batch_size = getattr(dataloader, "batch_size", None)
    dataset = getattr(dataloader, "dataset", None)
    try:
        samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return set()
    if not isinstance(batch_size, int) or samples == 0:
        return set()
    sizes = {min(batch_size, samples)}
    if samples % batch_size and not getattr(dataloader, "drop_last", False):
        sizes.add(samples % batch_size)
    return sizes


def check_batch_sizes(dataloader: object, chunks: int, modules: torch.nn.Module, training: bool) -> None:
    """Fail at fit start, on every stage alike, for batches that would fail later on one stage.

    Raises:
        NASPipeConfigError: a batch smaller than ``chunks``, or (training) 1-sample micro-batches
            through ``BatchNorm1d``, which cannot normalise one sample.
    """
    sizes = batch_sizes(dataloader)
    if not sizes:
        return
    smallest = min(sizes)
    where = (f"the dataloader's batches have {sorted(sizes)} samples (len(dataset)="
             f"{len(getattr(dataloader, 'dataset'))}, batch_size={getattr(dataloader, 'batch_size')})")
    if smallest < chunks:
        raise NASPipeConfigError(
            f"Micro-batching (chunks={chunks}) splits every batch into {chunks} micro-batches, but {where}. Use "
            "DataLoader(drop_last=True), a batch_size that divides the dataset, or fewer chunks (the module's chunks)."
        )
    if training and smallest // chunks == 1 and any(isinstance(m, torch.nn.BatchNorm1d) for m in modules.modules()):
        raise NASPipeConfigError(
            f"With chunks={chunks}, {where}, so a micro-batch can hold 1 sample, and the supernet's BatchNorm1d "
            "cannot normalise one sample in training ('Expected more than 1 value per channel'). Use "
            "DataLoader(drop_last=True), a larger batch_size, or fewer chunks."
        )


def _refuse_per_sample_values(batch: Any, size: int, chunks: int) -> None:
    """A list or tuple of ``size`` non-tensor values is per-sample data that splitting would not split."""
    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            return
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
        if isinstance(value, (list, tuple)) and len(value) == size and not any(isinstance(v, torch.Tensor)
                                                                                for v in value):
            raise NASPipeConfigError(
                f"chunks={chunks} splits the batch's tensors along dim 0, but it also holds a "
                f"{type(value).__name__} of {size} non-tensor values (one per sample?), which every micro-batch "
                "would get whole. Put per-sample values in a tensor, or use chunks=1."
            )
        for item in items:
            walk(item)

    walk(batch)
