"""The global norm of one subnet's gradients across pipeline stages, bit for bit as one device computes it.

``torch.nn.utils.clip_grad_norm_`` on one device computes the norm of each gradient
(``torch._foreach_norm`` or ``vector_norm``, per device and dtype group), stacks those norms in
parameter order, takes their norm, and scales every gradient by ``max_norm / (total + 1e-6)``
clamped to 1. Megatron and DeepSpeed add up partial sums of squares per stage instead: another
summation order, other bits. Here a stage computes its gradients' norms exactly as the one device
does (a tensor's norm depends on that tensor only), the stages exchange those per-tensor norms, not
sums, and stage 0 stacks them in the one-device order and computes the total. Every stage then
scales its own gradients by that same total, as the one device scales all of them.

The exchange rides the pipeline's links inside the update ``U(i)`` (``Schedule.norms`` orders it)::

    up      S-1 ─► S-2 ─► ... ─► 0      each stage passes on its record with those from below
    down      0 ─► 1   ─► ... ─► S-1    stage 0's verdict: the total, "nobody clipped", or an error

Two messages a link per subnet, ``S - 1`` hops each way after stage 0's last backward of the subnet.
Every stage runs the same hooks, so each update exchanges exactly once: an update whose code did not
clip sends an empty record, and stage 0 checks that the records agree (all clipped or none, the same
arguments, parameter lists of one structure) so that every stage stops with the same error if not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_naspipe.compat.torch import (device_has_foreach_support, foreach_norm, group_tensors_by_device_and_dtype,
                                           has_foreach_support)
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.transport.wire import CODE, DTYPES

__all__ = ["NormExchange", "NormLinks", "StageNorms", "combine", "local_norms", "total_norm"]

_INTS = 8  # int64 header slots of a packed record, before its (optimizer key, list key, dtype) triples
_SKIP, _TOTAL, _CONFIG_ERROR, _ERROR = range(4)  # verdicts


def local_norms(grads: Sequence[Tensor], norm_type: float, foreach: bool | None) -> list[Tensor]:
    """Each gradient's norm, computed as ``clip_grad_norm_`` computes it (per device and dtype group,
    ``torch._foreach_norm`` where it applies); in the order of ``grads``."""
    if not grads:
        return []
    norms: list[Tensor] = [torch.empty(0)] * len(grads)
    grouped = group_tensors_by_device_and_dtype([list[Tensor | None](grads)], with_indices=True)
    for (device, _), ([group], indices) in grouped.items():
        tensors = [t for t in group if t is not None]  # all of them: the first list holds no None
        if (foreach is None and has_foreach_support(tensors, device)) or (
                foreach and device_has_foreach_support(device)):
            found = foreach_norm(tensors, norm_type)
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            found = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for i, norm in zip(indices, found):
            norms[i] = norm
    return norms


def total_norm(values: Tensor, dtypes: Sequence[torch.dtype], norm_type: float) -> Tensor:
    """The norm of per-tensor norms, as ``clip_grad_norm_`` stacks them: ``values`` (float64, exact) and
    ``dtypes`` are the norms in the one-device parameter order, on the device that computes the total;
    stacked in dtype groups in torch's group order when dtypes mix."""
    if not dtypes:
        return torch.tensor(0.0)  # torch's total of no gradients
    if len(set(dtypes)) == 1:
        stacked = values.to(dtypes[0])  # what torch.stack of the 0-dim norms gives, in one op
    else:  # the same (device, dtype) keys in the same order group alike
        norms = list[Tensor | None](v.to(d) for v, d in zip(values, dtypes))
        grouped = group_tensors_by_device_and_dtype([norms], with_indices=True)
        stacked = torch.stack([norms[i] for _, (_, indices) in grouped.items() for i in indices])  # type: ignore[misc]
    total: Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


@dataclass
class StageNorms:
    """One stage's part of a ``clip_grad_norm_`` call in an update (``called=False``: it made none).

    Attributes:
        keys: int64 ``(norms, 2)``: per norm, ``(optimizer key, list key)``: the gradient's parameter's position
            in the optimizer's unrestricted param groups (``-1`` if not there) and in the list the call got.
        values: the norms, float64 (exact for every float dtype), 1-D; ``dtypes``: each one's own dtype.
        by_optimizer: the call got exactly the optimizer's (subnet-restricted) parameters, as
            Lightning's ``clip_gradients`` passes them: order by optimizer key, else by list key.
        length: how many parameters the call got (the same on every stage unless ``by_optimizer``).
    """

    stage: int
    called: bool = False
    by_optimizer: bool = False
    length: int = 0
    max_norm: float = 0.0
    norm_type: float = 2.0
    error_if_nonfinite: bool = False
    foreach: bool | None = None
    keys: Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))
    values: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    dtypes: list[torch.dtype] = field(default_factory=list)

    @classmethod
    def local(cls, stage: int, keys: list[tuple[int, int]], norms: Sequence[Tensor], **call: Any) -> StageNorms:
        """A clipping call's record from this stage's 0-dim ``norms``; ``call``: the call's other fields."""
        values = torch.stack(list(norms)).to(torch.float64) if norms else torch.zeros(0, dtype=torch.float64)
        return cls(stage, True, keys=torch.tensor(keys, dtype=torch.int64).view(-1, 2), values=values,
                   dtypes=[n.dtype for n in norms], **call)

    def pack(self) -> tuple[Tensor, Tensor]:
        """Two tensors: int64 header and ``(optimizer key, list key, dtype)`` triples, float64 arguments and norms."""
        foreach = -1 if self.foreach is None else int(self.foreach)
        head = torch.tensor([self.stage, int(self.called), int(self.by_optimizer), self.length,
                             int(self.error_if_nonfinite), foreach, len(self.keys), 0])
        codes = torch.tensor([CODE[dtype] for dtype in self.dtypes], dtype=torch.int64).view(-1, 1)
        floats = torch.tensor([self.max_norm, self.norm_type], dtype=torch.float64)
        return (torch.cat([head, torch.cat([self.keys, codes], 1).view(-1)]),
                torch.cat([floats.to(self.values.device), self.values]))

    @classmethod
    def unpack(cls, ints: Tensor, floats: Tensor, device: torch.device) -> StageNorms:
        """The record :meth:`pack` packed, its norms on ``device``."""
        head, triples = ints[:_INTS].tolist(), ints[_INTS:].view(-1, 3)
        arguments = floats[:2].tolist()
        return cls(head[0], bool(head[1]), bool(head[2]), head[3], arguments[0], arguments[1], bool(head[4]),
                   None if head[5] < 0 else bool(head[5]), triples[:, :2], floats[2:].to(device),
                   [DTYPES[code] for code in triples[:, 2].tolist()])


def combine(records: Sequence[StageNorms], subnet: int) -> Tensor | None:
    """The total norm of every stage's records, as one device computes it (on the device of the records'
    values); ``None`` if no stage clipped.

    Raises:
        NASPipeConfigError: the stages did not make the same call.
    """
    clipped = [r.stage for r in records if r.called]
    if not clipped:
        return None
    where = f"in subnet {subnet}'s optimizer step"
    if len(clipped) < len(records):
        raise NASPipeConfigError(
            f"clip_grad_norm_ ran on stage(s) {clipped} but not on {[r.stage for r in records if not r.called]} "
            f"{where}: every stage must run the same clipping code, which needs every stage's gradients.")
    settings = {(r.max_norm, r.norm_type, r.error_if_nonfinite, r.foreach) for r in records}
    if len(settings) > 1:
        raise NASPipeConfigError(f"clip_grad_norm_ got other arguments on different stages {where} (max_norm, "
                                 f"norm_type, error_if_nonfinite, foreach: {sorted(settings, key=str)}).")
    by_optimizer = all(r.by_optimizer for r in records)
    if not by_optimizer and len({r.length for r in records}) > 1:
        raise NASPipeConfigError(
            f"clip_grad_norm_ got parameter lists of different lengths on different stages {where} "
            f"({[r.length for r in records]}): pass the same parameters on every stage (e.g. self.parameters(), "
            "not a list filtered by which gradients this stage holds), or use Trainer(gradient_clip_val=...).")
    positions = torch.cat([r.keys[:, 0 if by_optimizer else 1] for r in records])
    if len(set(positions.tolist())) < len(positions):
        raise NASPipeConfigError(f"clip_grad_norm_ got one parameter's gradient on two stages {where}: pass the "
                                 "same parameter list on every stage (e.g. self.parameters()).")
    values = torch.cat([r.values for r in records])
    dtypes = [d for r in records for d in r.dtypes]
    if len(positions) > 1 and bool((positions[1:] < positions[:-1]).any()):  # the stages' order is not the device's
        order = positions.argsort()
        values, dtypes = values[order.to(values.device)], [dtypes[n] for n in order.tolist()]
    return total_norm(values, dtypes, records[0].norm_type)


class NormLinks(Protocol):
    """The part of a stage's transport the exchange uses (see :class:`.executor.Transport`)."""

    def send_norms(self, subnet: int, stage: int, value: Any) -> None: ...

    def recv_norms(self, subnet: int, stage: int) -> Any: ...


class NormExchange:
    """One update's norm exchange on one stage (see the module docstring).

    Args:
        links: the stage's transport.
        stage: this stage.
        num_stages: how many stages there are (more than one).
        subnet: the global index of the subnet being updated: the messages' key.
        device: where stage 0 computes the total (its compute device).
    """

    def __init__(self, links: NormLinks, stage: int, num_stages: int, subnet: int, device: torch.device) -> None:
        self.links, self.stage, self.last, self.subnet, self.device = links, stage, num_stages - 1, subnet, device

    def agree(self, record: StageNorms) -> Tensor | None:
        """Exchange ``record`` with every stage; the total norm (on this stage's device), ``None`` if no
        stage clipped. Every stage returns the same, or raises the same error after passing it on."""
        gathered = list(record.pack())
        if self.stage < self.last:
            gathered += self.links.recv_norms(self.subnet, self.stage + 1)
        if self.stage > 0:
            self.links.send_norms(self.subnet, self.stage - 1, tuple(gathered))
            verdict = self.links.recv_norms(self.subnet, self.stage - 1)
        else:
            verdict = self._decide(gathered)
        if self.stage < self.last:
            self.links.send_norms(self.subnet, self.stage + 1, verdict)
        status = int(verdict[0].item())
        if status == _SKIP:
            return None
        if status == _TOTAL:
            return verdict[1]  # type: ignore[no-any-return]
        text = bytes(verdict[1].tolist()).decode()
        raise NASPipeConfigError(text) if status == _CONFIG_ERROR else RuntimeError(text)

    def _decide(self, gathered: list[Tensor]) -> tuple[Tensor, ...]:
        records = [StageNorms.unpack(gathered[k], gathered[k + 1], self.device) for k in range(0, len(gathered), 2)]
        try:
            total = combine(records, self.subnet)  # in stage order: this stage's, then those from below
        except Exception as error:  # sent down first, so that every stage stops with it instead of waiting
            status = _CONFIG_ERROR if isinstance(error, NASPipeConfigError) else _ERROR
            text = str(error) if status == _CONFIG_ERROR else f"{type(error).__name__}: {error}"
            return torch.tensor([status]), torch.tensor(list(text.encode()), dtype=torch.uint8)
        if total is None:
            return (torch.tensor([_SKIP]),)
        return torch.tensor([_TOTAL]), total
