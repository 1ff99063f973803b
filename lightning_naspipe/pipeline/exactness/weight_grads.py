"""Input gradients first, weight gradients after the send: a block's backward in two passes.

Why: the stage before waits for this stage's input gradients, but not for its weight gradients. A
block's backward computes both; the *input* pass runs autograd only along the paths that reach the
block's input leaves, and at every node where a parameter's path branches off that path (an
*intersection*, e.g. a Linear's ``AddmmBackward``: one output toward the input, one toward the
weight) it keeps the gradient the node received. The *weight* pass later feeds those gradients
back into the same nodes, which now compute only their parameter-side outputs. Nothing is computed
twice, and every kernel sees the values it sees in a one-pass backward, so the gradients are
bitwise those of :func:`~.boundary.backward_through` (``tests/test_weight_grads.py``).

Graph shape (``x`` a block input leaf, ``W`` a parameter; the input pass runs the ``X`` side)::

    output ─► GeluBackward ─► AddmmBackward ─┬─► x            (X side: reaches an input leaf)
                              (intersection) ├─► TBackward ─► W   (weight side)
                                             └─► b

A block whose graph does not split cleanly (a parameter that reaches an output without crossing the
input paths or meets them at two nodes, a gradient for a tensor that is neither an input leaf nor a
given parameter, a custom ``autograd.Function``) runs its one-pass backward instead, after the weight
passes of the blocks behind it, so every gradient accumulates in the one-pass order. A hook that a
block's forward registers on an intermediate tensor (``Tensor.register_hook``) is called again in the
weight pass when that tensor's node is an intersection; its result is not used there (the node gets
the gradients of the input pass), so values are unchanged, but a hook with side effects sees them twice.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_naspipe.space.boundary import backward_through, grad_targets, laid_out, leaf_grads


@dataclass
class _Group:
    """The parameters whose paths meet the input paths at one node (the intersection), and the
    gradients that node received in the input pass."""

    node: Node
    params: list[Tensor]
    grads: tuple[Tensor | None, ...] = ()


@dataclass
class DeferredWeights:
    """Weight-gradient passes of blocks whose input gradients were already computed, in block order
    (last block first, as a one-pass backward accumulates them).

    Attributes:
        after_block: called after each block's weight pass, one accumulation onto ``.grad`` as a block's one-pass
            backward is (a later data-parallel replica takes each as an addend of its own, see :mod:`.replicas`).
    """

    after_block: Callable[[], None] | None = None
    _pending: list[list[_Group]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        """Accumulate every pending weight gradient into ``.grad``, oldest block first."""
        pending, self._pending = self._pending, []
        for groups in pending:
            for group in groups:
                roots = [(GradientEdge(group.node, nr), g) for nr, g in enumerate(group.grads) if g is not None]
                if not roots:
                    continue
                # A hook the block's forward put on the node's output tensor runs again here; the node
                # gets the gradients it got in the input pass, where that hook already ran, all the same.
                handle = group.node.register_prehook(lambda _, kept=group.grads: kept)
                try:
                    torch.autograd.backward([r for r, _ in roots], [g for _, g in roots], inputs=group.params)
                finally:
                    handle.remove()
            if self.after_block is not None:
                self.after_block()

    def backward(self, outputs: object, grads: Sequence[Tensor | None], inputs: object,
                 params: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
        """One block's backward with its weight gradients deferred to :meth:`run`.

        Args:
            outputs: the block's output (any nesting); ``grads`` align with its :func:`grad_targets`.
            grads: the gradients the next block's input leaves received (``None``: none arrived).
            inputs: the block's input (its leaves, see :func:`~.boundary.cut`).
            params: the parameters the block may use.

        Returns:
            The input leaves' gradients, as :func:`~.boundary.leaf_grads` gives them after
            :func:`~.boundary.backward_through`.
        """
        targets = grad_targets(outputs)
        if len(targets) != len(grads):
            raise RuntimeError(f"a block boundary got {len(grads)} gradients for {len(targets)} tensors that need one")
        pairs = [(t, g) for t, g in zip(targets, grads) if g is not None]
        leaves = grad_targets(inputs)
        # Nothing flows to the inputs, or the graph does not split: the one-pass backward, after the blocks before it.
        groups = _split(pairs, leaves, [p for p in params if p.requires_grad]) if pairs and leaves else None
        if groups is None:
            self.run()
            backward_through(outputs, grads)
            return leaf_grads(inputs)
        handles = [group.node.register_prehook(_keep(group)) for group in groups]
        try:
            found = torch.autograd.grad([t for t, _ in pairs], leaves, [g for _, g in pairs], retain_graph=True,
                                        allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        self._pending.append(groups)
        return tuple(None if g is None else laid_out(g) for g in found)


def _keep(group: _Group) -> Callable[[tuple[Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        group.grads = grad_outputs
    return hook


def _node(tensor: Tensor) -> Node:
    return get_gradient_edge(tensor).node


def _split(pairs: Sequence[tuple[Tensor, Tensor]], leaves: Sequence[Tensor],
           params: Sequence[Tensor]) -> list[_Group] | None:
    """The parameter groups of a block's graph and where each meets the input paths; ``None`` when
    the graph does not split cleanly (see the module docstring)."""
    roots = {_node(t) for t, _ in pairs}
    users: dict[Node, list[Node]] = {}  # node -> the nodes that feed it gradients (reverse edges)
    queue = list(roots)
    seen = set(roots)
    while queue:
        node = queue.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    known = {id(t) for t in (*leaves, *params)}
    if any(id(getattr(node, "variable", None)) not in known for node in seen if hasattr(node, "variable")):
        return None  # a tensor outside the block's parameters gets a gradient: only one pass can be sure of it
    if any(isinstance(node, BackwardCFunction) for node in seen):
        return None  # a custom autograd.Function (reentrant checkpointing, module backward hooks) may not rerun
    input_side = {_node(leaf) for leaf in leaves} & seen
    queue = list(input_side)
    while queue:  # every node with a path to an input leaf
        for user in users.get(queue.pop(), ()):
            if user not in input_side:
                input_side.add(user)
                queue.append(user)
    groups: dict[Node, _Group] = {}
    for param in params:
        start = _node(param)
        if start not in seen:
            continue  # unused by this subnet's path through the block
        met: set[Node] = set()
        closure, queue = {start}, [start]
        while queue:
            node = queue.pop()
            if node in roots:
                return None  # reaches an output without crossing the input paths
            for user in users.get(node, ()):
                if user in input_side:
                    met.add(user)
                elif user not in closure:
                    closure.add(user)
                    queue.append(user)
        if len(met) != 1:
            return None  # one intersection per parameter keeps each weight pass a single root set
        node = met.pop()
        groups.setdefault(node, _Group(node, [])).params.append(param)
    return list(groups.values())


class DeferralChooser:
    """Decides, by measuring the run, whether a stage defers its weight gradients.

    Deferring pays where the stage before idles for this stage's input gradients: where consecutive
    subnets share a resource on an earlier stage (a trainable stem) and each subnet is one batch
    (``chunks=1``), CSP keeps one subnet in flight, every backward's input gradients are on the
    critical path, and the weight pass runs while the stages before compute. It costs where the stages
    are all busy (micro-batches, independent subnets): the two passes add Python graph walks and
    autograd calls, and a few kernels (BatchNorm's) do work twice. So a stage (never the first:
    nothing waits for its input gradients) considers it only in such *eligible* windows, alternates the
    two ways window by window over its first ``trials`` eligible windows each, timing how long each
    backward takes to send its input gradients, and defers when the median of that time is below
    ``margin`` times the one-pass median. Results never depend on the choice.

    Args:
        trials: eligible windows measured each way before the choice.
        forced: ``True``/``False``: always/never defer (the first stage never does); ``None`` measures.
        margin: how much sooner deferring must send, as a fraction of the one-pass time.
    """

    def __init__(self, trials: int = 3, forced: bool | None = None, margin: float = 0.95) -> None:
        self.trials = trials
        self.forced = forced
        self.margin = margin
        self._seconds: dict[bool, list[list[float]]] = {False: [], True: []}
        self._blocks: range | None = None

    @property
    def decided(self) -> bool | None:
        """The measured choice, once every trial has run (``None`` before)."""
        joint, deferred = self._seconds[False], self._seconds[True]
        if min(len(joint), len(deferred)) < self.trials:
            return None
        return _median(deferred) < self.margin * _median(joint)

    def pick(self, blocks: range, first_stage: bool, eligible: bool) -> bool:
        """Whether the next window on a stage running ``blocks`` defers (a new range measures anew)."""
        if blocks != self._blocks:
            self._blocks, self._seconds = blocks, {False: [], True: []}
        if first_stage:
            return False
        if self.forced is not None:
            return self.forced
        if not eligible:
            return False
        decided = self.decided
        if decided is not None:
            return decided
        return len(self._seconds[True]) < len(self._seconds[False])

    def record(self, deferred: bool, seconds_to_send: Sequence[float]) -> None:
        """An eligible window's times from each backward's start to its input gradients' send."""
        if self.forced is None and self.decided is None and seconds_to_send:
            self._seconds[deferred].append(list(seconds_to_send))


def _median(windows: Sequence[Sequence[float]]) -> float:
    values = sorted(v for window in windows for v in window)
    return values[len(values) // 2]


def serialised(resources: Sequence[Sequence[AbstractSet[Hashable]]], size: int, stage: int) -> bool:
    """Whether at least half of the consecutive pairs of a window's first ``size`` subnets share a
    resource on a stage before ``stage`` (``resources[k][s]``: subnet ``k``'s on stage ``s``)."""
    pairs = [any(resources[k][s] & resources[k + 1][s] for s in range(stage)) for k in range(size - 1)]
    return bool(pairs) and 2 * sum(pairs) >= len(pairs)
