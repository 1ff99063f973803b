"""Cells: DAG search spaces (NAS-Bench-201, DARTS) as small supernet blocks.

A :class:`Cell` is a directed acyclic graph of *nodes*. The first ``inputs`` nodes are the cell's
inputs; every later node ``j`` is the sum of ``op(i, j)(state_i)`` over its predecessors
``i < j``. Passed to :class:`~.supernet.Supernet`, a cell contributes one block per edge, so
the pipeline may cut inside it (NAS-Bench-201, 4 nodes)::

    entry        x                  -> (s0,)
    edge 0 -> 1  (s0,)              -> (s0, s1)          s1 = op01(s0)
    edge 0 -> 2  (s0, s1)           -> (s0, s1, p2)      p2 = op02(s0)
    edge 1 -> 2  (s0, s1, p2)       -> (s0, s1, s2)      s2 = p2 + op12(s1)
    ...          edges 0 -> 3, 1 -> 3, 2 -> 3 likewise
    exit         (s0, s1, s2, s3)   -> s3

Edges into ``j`` are added in increasing ``i`` into a running sum, the last item of the state
tuple, so the summation order never depends on where a pipeline cut falls. An edge's op may
return ``None`` for "contributes nothing" (:class:`~.choice.When` does when inactive).

NAS-Bench-201 in a few lines (labels are shared by every cell built with ``nb201_op``)::

    def nb201_op(i: int, j: int) -> lnp.ChoiceBlock:
        return lnp.ChoiceBlock({
            "none": lnp.Zero(),
            "skip": nn.Identity(),
            "conv1x1": nn.Sequential(nn.ReLU(), nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16)),
            "conv3x3": nn.Sequential(nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)),
            "avgpool": nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
        }, label=f"e{i}{j}")

    supernet = lnp.Supernet(stem, lnp.Cell(4, nb201_op), lnp.Cell(4, nb201_op), head)

A node's state feeds several edges, so a candidate must not modify its input in place (no
``nn.ReLU(inplace=True)`` as its first layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, cast

import torch
from torch import Tensor, nn

from lightning_naspipe.space.choice import InputChoice, When
from lightning_naspipe.space.supernet import describe
from lightning_naspipe.errors import NASPipeConfigError

__all__ = ["Cell", "Zero"]

#: What travels between a cell's blocks: node states, then (inside a node) its running sum.
State = tuple[Optional[Tensor], ...]
OUTPUTS = ("last", "concat")


class Zero(nn.Module):
    """The "none" op of NAS-Bench-201 and DARTS: zeros shaped like its input.

    It has no parameters, so it is no resource and conflicts with no subnet.

    Args:
        stride: spatial subsampling of the last two dimensions (2 in a DARTS reduction cell).
    """

    def __init__(self, stride: int = 1) -> None:
        super().__init__()
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise NASPipeConfigError(f"Zero(stride={stride!r}): stride is a whole number >= 1, e.g. Zero(stride=2).")
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x if self.stride == 1 else x[..., :: self.stride, :: self.stride])


class Cell(nn.Module):
    """A DAG cell whose every edge is a supernet block (see the module docstring).

    Args:
        nodes: how many nodes, numbered ``0 .. nodes - 1``; the first ``inputs`` of them are the
            cell's inputs (NAS-Bench-201: 4, DARTS: 6 = 2 inputs + 4 computed nodes).
        op: ``op(i, j)`` returns the module of edge ``i -> j`` (typically a
            :class:`~.choice.ChoiceBlock` labelled after the edge). It is called once per edge, in
            block order; cells built with the same ``op`` labels share decisions, not weights.
        inputs: how many input nodes. With 1 the cell takes a tensor; with more, a tuple of them.
        choose: ``None`` sums every edge into a node (NAS-Bench-201). ``k`` makes each computed
            node choose ``k`` of its predecessors (DARTS: 2) under the label
            ``f"{prefix}n{j}_inputs"`` (an :class:`~.choice.InputChoice`); an unchosen edge
            does not run and its op is no resource of the subnet.
        output: ``"last"``: the last node's state (NAS-Bench-201); ``"concat"``: the computed
            nodes' states concatenated along dim 1 (DARTS).
        prefix: starts the labels the cell creates (``choose``); give DARTS normal and reduction
            cells different prefixes, cells that share a genotype the same one.
        preprocess: one module per input, applied to it on entry (DARTS' ``preprocess0/1``).
        chain: return ``(last input, output)``, the next DARTS cell's ``(s0, s1)``, where the
            last input is taken before ``preprocess``.
    """

    def __init__(
        self,
        nodes: int,
        op: Callable[[int, int], nn.Module],
        *,
        inputs: int = 1,
        choose: int | None = None,
        output: str = "last",
        prefix: str = "",
        preprocess: Sequence[nn.Module] | None = None,
        chain: bool = False,
    ) -> None:
        super().__init__()
        _check_arguments(nodes, op, inputs, choose, output, prefix, preprocess, chain)
        offset = 1 if chain else 0  # the state starts with the raw last input when chaining
        self.nodes, self.inputs, self.choose, self.output, self.chain = nodes, inputs, choose, output, chain
        self.edges = [(i, j) for j in range(inputs, nodes) for i in range(j)]
        #: Per computed node, the label of its input choice (``choose`` only).
        self.input_labels = {j: f"{prefix}n{j}_inputs" for j in range(inputs, nodes)} if choose else {}
        choices = {j: InputChoice(j, choose, label) for j, label in self.input_labels.items()} if choose else {}
        self._ops: dict[tuple[int, int], nn.Module] = {}
        blocks: list[nn.Module] = [_Entry(inputs, preprocess, chain)]
        for i, j in self.edges:
            module = op(i, j)
            if not isinstance(module, nn.Module):
                raise NASPipeConfigError(
                    f"Cell op({i}, {j}) returned a {type(module).__name__}; it must return the nn.Module of edge "
                    f"{i} -> {j}, e.g. lnp.ChoiceBlock({{...}}, label=f'e{{i}}{{j}}')."
                )
            self._ops[i, j] = module
            if j in choices:
                module = When(module, self.input_labels[j], choices[j].subsets_with(i))
            # The first edge into j holds j's InputChoice, so that the supernet registers its label.
            blocks.append(_Edge(module, offset + i, node=j, first=i == 0, last=i == j - 1,
                                choice=choices.get(j) if i == 0 else None))
        blocks.append(_Exit(offset + (inputs if output == "concat" else nodes - 1), chain))
        self.blocks = nn.ModuleList(blocks)

    def edge_op(self, i: int, j: int) -> nn.Module:
        """The module ``op(i, j)`` returned for edge ``i -> j`` (before any :class:`~.choice.When`)."""
        return self._ops[i, j]

    def supernet_blocks(self) -> list[nn.Module]:
        """The blocks :class:`~.supernet.Supernet` runs in order: entry, one per edge, exit."""
        return list(self.blocks)

    def forward(self, x: object) -> object:
        """All the cell's blocks in order (a cell inside a fixed block; the pipeline cannot cut it)."""
        for block in self.blocks:
            x = block(x)
        return x


class _Entry(nn.Module):
    """Input value -> ``(raw last input if chaining, s0, s1, ...)``."""

    def __init__(self, inputs: int, preprocess: Sequence[nn.Module] | None, chain: bool) -> None:
        super().__init__()
        self.inputs, self.chain = inputs, chain
        self.preprocess = nn.ModuleList(preprocess) if preprocess is not None else None

    def forward(self, value: object) -> State:
        raw = (value,) if isinstance(value, Tensor) else value
        if not isinstance(raw, (tuple, list)) or len(raw) != self.inputs or not all(
                isinstance(t, Tensor) for t in raw):
            wanted = "a tensor" if self.inputs == 1 else f"a tuple of {self.inputs} tensors"
            raise NASPipeConfigError(
                f"A Cell with inputs={self.inputs} takes {wanted}, got {describe(value)}; make the block before "
                "it return that (a DARTS cell before it: chain=True)."
            )
        states: list[Tensor] = list(raw)
        if self.preprocess is not None:
            states = [module(t) for module, t in zip(self.preprocess, states)]
        return (raw[-1], *states) if self.chain else tuple(states)


class _Edge(nn.Module):
    """Edge ``i -> j``: adds ``op(state[position])`` into node ``j``'s running sum, the state's last item."""

    def __init__(self, op: nn.Module, position: int, *, node: int, first: bool, last: bool,
                 choice: InputChoice | None) -> None:
        super().__init__()
        self.choice = choice  # registers node j's InputChoice label with the supernet (first edge only)
        self.op = op
        self.position, self.first, self.last, self.node = position, first, last, node

    def forward(self, state: State) -> State:
        out = self.op(state[self.position])
        if out is not None and not isinstance(out, Tensor):
            raise TypeError(f"the op of an edge into Cell node {self.node} returned a {type(out).__name__}, "
                            "not a tensor (or None for 'contributes nothing')")
        head, total = (state, None) if self.first else (state[:-1], state[-1])
        total = out if total is None else total if out is None else total + out
        if self.last and total is None:
            raise RuntimeError(f"Cell node {self.node} got no input: every edge into it returned None under this "
                               "architecture. Use lnp.Zero() for an op that contributes zeros.")
        return (*head, total)


class _Exit(nn.Module):
    """Node states -> the cell's output: the last node, or ``cat(states[first:], dim=1)``."""

    def __init__(self, first: int, chain: bool) -> None:
        super().__init__()
        self.first, self.chain = first, chain

    def forward(self, state: State) -> object:
        nodes = cast("list[Tensor]", list(state[self.first:]))  # every node's last edge checked it is set
        out = nodes[0] if len(nodes) == 1 else torch.cat(nodes, dim=1)
        return (state[0], out) if self.chain else out


def _check_arguments(nodes: int, op: object, inputs: int, choose: int | None, output: str, prefix: str,
                     preprocess: Sequence[nn.Module] | None, chain: bool) -> None:
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(inputs) or inputs < 1:
        raise NASPipeConfigError(f"Cell(inputs={inputs!r}): inputs is the number of input nodes, >= 1 "
                                 "(NAS-Bench-201: 1, DARTS: 2).")
    if not whole(nodes) or nodes <= inputs:
        raise NASPipeConfigError(
            f"Cell(nodes={nodes!r}, inputs={inputs}): nodes counts the input nodes too, so it must exceed inputs; "
            f"e.g. Cell({inputs + 3}, op, inputs={inputs}) has {inputs} input(s) and 3 computed nodes.")
    if not callable(op) or isinstance(op, nn.Module):
        raise NASPipeConfigError(f"Cell op must be a function op(i, j) returning edge i -> j's module, got a "
                                 f"{type(op).__name__}; e.g. Cell(4, lambda i, j: lnp.ChoiceBlock(..., "
                                 "label=f'e{i}{j}')).")
    if choose is not None and (not whole(choose) or not 1 <= choose <= inputs):
        raise NASPipeConfigError(
            f"Cell(choose={choose!r}): choose is how many predecessors each computed node picks, between 1 and "
            f"{inputs} (the first computed node, {inputs}, has {inputs}); or choose=None to sum every edge "
            "(NAS-Bench-201).")
    if output not in OUTPUTS:
        raise NASPipeConfigError(f"Cell(output={output!r}): write output='last' (NAS-Bench-201: the last node) or "
                                 "output='concat' (DARTS: the computed nodes concatenated along dim 1).")
    if not isinstance(prefix, str):
        raise NASPipeConfigError(f"Cell(prefix={prefix!r}): the label prefix is a str, e.g. prefix='reduce_'.")
    if preprocess is not None and (not isinstance(preprocess, (list, tuple, nn.ModuleList)) or len(preprocess) != inputs
                                   or not all(isinstance(m, nn.Module) for m in preprocess)):
        raise NASPipeConfigError(f"Cell(preprocess=...) takes a list of one nn.Module per input ({inputs}), e.g. "
                                 "preprocess=[conv_bn(c_prev_prev, c), conv_bn(c_prev, c)]; use nn.Identity() to "
                                 "leave an input as it is.")
    if not isinstance(chain, bool):
        raise NASPipeConfigError(f"Cell(chain={chain!r}): chain is True or False.")
