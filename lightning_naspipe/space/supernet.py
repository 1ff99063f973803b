"""The search space: an ordered sequence of blocks, some of them choices between candidate ops.

A *subnet* (architecture) is a ``dict[label, candidate index]``: one decision per label. Blocks
that share a label share one decision, so a label must name blocks with equal candidate counts.
Choices may also sit inside blocks and inside candidates (see :mod:`.choice`).

A *resource* is something two subnets must not use at the same time on one stage without
ordering (the CSP rule): a set of parameters and buffers. Each block's module tree is cut into
*scopes* at its choices (a fixed part, each candidate's part); scopes that share any tensor, a
tied weight or a module reused in two places, are one resource, keyed by the path of the first
such scope. Parameter- and buffer-free scopes (``nn.Identity``, pooling, activations) are no
resource and conflict with nothing.

What one block passes to the next is a :data:`BlockValue`; :func:`describe` names one in short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from torch import Tensor, nn

from lightning_naspipe.compat.torch import module_buffers, pytree
from lightning_naspipe.space.choice import (Architecture, ChoiceBlock, Elastic, Scope, When, active_architecture,
                                            block_scope)
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.freezing import freeze

__all__ = ["BlockValue", "Resource", "ResourceState", "Supernet", "describe"]

#: A resource's key: the path of its first scope, e.g. ``(block, candidate)``; candidate ``-1``
#: for a fixed block, longer paths for nested choices (see :class:`~.choice.Scope`).
Resource = tuple[int, ...]

#: A value one block passes to the next, and so one stage to the next: a tensor, or any nesting of
#: tuples, lists and dicts of tensors and plain Python values (see :class:`Supernet`). Its structure
#: is the user's, so to the type checker it is ``Any``; the name says what flows.
BlockValue: TypeAlias = Any


@dataclass(frozen=True)
class ResourceState:
    """The tensors of one resource: its parameters (each once) and every buffer slot."""

    params: tuple[nn.Parameter, ...]
    buffers: tuple[tuple[nn.Module, str], ...]

    def tensors(self) -> list[Tensor]:
        """Its parameters and the buffers in its slots now (a slot may hold ``None``)."""
        buffers = (module_buffers(module)[name] for module, name in self.buffers)
        return [*self.params, *(b for b in buffers if b is not None)]


class Supernet(nn.Module):
    """The supernet: ``blocks`` applied in order; each block's output feeds the next.

    A block passes one value to the next: a tensor, or any nesting of tuples, lists and dicts
    of tensors and plain Python values (ints, ``None``, strings). Every block boundary is a
    gradient boundary, so where the pipeline cuts never changes the arithmetic.

    Args:
        *blocks: plain ``nn.Module`` blocks (fixed, used by every subnet, possibly with
            :class:`ChoiceBlock` inside), :class:`ChoiceBlock`, or an object with a
            ``supernet_blocks()`` method (e.g. :class:`~.cells.Cell`), which contributes its blocks
            in order so that the pipeline may cut inside it. Elastic modules (:class:`~.choice.Elastic`,
            e.g. ``ElasticLinear``) may sit anywhere too: each elastic dimension is a label, numbered
            like a choice's candidates (choice ``k`` is the ``k``-th size).
    """

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        if len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
            blocks = tuple(blocks[0])
        expanded: list[nn.Module] = []
        for i, block in enumerate(blocks):
            expand = getattr(type(block), "supernet_blocks", None)
            parts = expand(block) if callable(expand) else [block]
            for part in parts:
                if not isinstance(part, nn.Module):
                    raise NASPipeConfigError(f"Supernet block {i} is a {type(part).__name__}, not an nn.Module.")
                expanded.append(part)
        if not expanded:
            raise NASPipeConfigError("Supernet needs at least one block: Supernet(block0, block1, ...).")
        self.blocks = nn.ModuleList(expanded)
        self.labels: dict[str, int] = {}  # label -> candidate count, in first-appearance order
        for i, block in enumerate(expanded):
            self._register_labels(i, block)
        self._check_whens()
        self._scopes = [block_scope(i, block) for i, block in enumerate(expanded)]
        self._key_of, self._states, self._blocks_of = self._index_resources()
        self._cache: dict[tuple[int, tuple[int, ...]], frozenset[Resource]] = {}
        self._block_labels = [sorted({label for s in root.walk() for label, _, _ in s.choices})
                              for root in self._scopes]
        #: Set by a multi-stage strategy while this process's copy is current only for these blocks.
        self.local_blocks: range | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def _register_labels(self, index: int, block: nn.Module) -> None:
        for name, module in block.named_modules(prefix=f"block{index}"):
            if isinstance(module, Supernet):
                raise NASPipeConfigError(
                    f"Block {index} contains a Supernet ({name}); a supernet cannot nest another. Pass its blocks "
                    "to the outer Supernet directly, or use ChoiceBlock inside the block."
                )
            if isinstance(module, Elastic):
                if module.__dict__.get("supernet_path") is None:  # a module used twice: named where it first is
                    module.supernet_path = f"supernet.blocks.{index}{name[len(f'block{index}'):]}"
                for dim_name, dim in module.dims.items():
                    if dim.label is None:
                        module.set_label(dim_name, f"{name}.{dim_name}")
                    assert dim.label is not None
                    self._add_label(dim.label, len(dim.values), f"{name} ({dim_name})")
            if not isinstance(module, ChoiceBlock):
                continue
            if module.label is None:
                module.label = name
            self._add_label(module.label, len(module), name)

    def _add_label(self, label: str, count: int, where: str) -> None:
        known = self.labels.setdefault(label, count)
        if known != count:
            raise NASPipeConfigError(
                f"Choices sharing label {label!r} have different candidate counts ({known} and {count} at {where}); "
                "give them equal counts or different labels."
            )

    def _check_whens(self) -> None:
        for name, module in self.blocks.named_modules():
            if isinstance(module, When) and (module.label not in self.labels or any(
                    not 0 <= v < self.labels[module.label] for v in module.values)):
                raise NASPipeConfigError(
                    f"When at {name} depends on label {module.label!r} with values {sorted(module.values)}, but the "
                    f"supernet's labels are {self.labels}; name a ChoiceBlock's label and valid choices."
                )

    def _index_resources(self) -> tuple[dict[tuple[int, ...], Resource], dict[Resource, ResourceState],
                                        dict[Resource, list[int]]]:
        """Merge scopes that share a tensor into one resource, keyed by the first scope's path: each scope's
        key, each resource's tensors and the blocks its scopes are in."""
        scopes = [s for root in self._scopes for s in root.walk() if s.params or s.buffers]
        parent = list(range(len(scopes)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[int, int] = {}
        for i, scope in enumerate(scopes):
            for tensor_id in scope.tensor_ids():
                j = owner.setdefault(tensor_id, i)
                a, b = find(i), find(j)
                parent[max(a, b)] = min(a, b)
        key_of = {s.path: scopes[find(i)].path for i, s in enumerate(scopes)}
        members: dict[Resource, list[Scope]] = {}
        for i, scope in enumerate(scopes):
            members.setdefault(key_of[scope.path], []).append(scope)
        states = {}
        for key, group in members.items():
            params = {id(p): p for s in group for p in s.params}
            slots = {(id(m), n): (m, n) for s in group for m, n in s.buffers}
            states[key] = ResourceState(tuple(params.values()), tuple(slots.values()))
        blocks_of = {key: sorted({s.path[0] for s in group}) for key, group in members.items()}
        return key_of, states, blocks_of

    def block_scopes(self, index: int) -> Scope:
        """Block ``index``'s scope tree (see :class:`~.choice.Scope`)."""
        return self._scopes[index]

    def validate(self, architecture: Mapping[str, int]) -> Architecture:
        """Check ``architecture`` against this space and return it as a plain dict.

        Raises:
            NASPipeConfigError: a label is missing or unknown, or an index is out of range.
        """
        if not isinstance(architecture, Mapping):
            raise NASPipeConfigError(
                f"An architecture is a dict[label, candidate index], got {type(architecture).__name__}."
            )
        unknown = sorted(set(architecture) - set(self.labels))
        if unknown:
            raise NASPipeConfigError(
                f"Architecture has unknown label(s) {unknown}; the supernet's labels are {list(self.labels)}."
            )
        missing = [label for label in self.labels if label not in architecture]
        if missing:
            raise NASPipeConfigError(f"Architecture lacks a choice for label(s) {missing}.")
        for label, count in self.labels.items():
            index = architecture[label]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                raise NASPipeConfigError(
                    f"Architecture chooses {index!r} for label {label!r}, which has {count} candidates "
                    f"(valid indices 0..{count - 1})."
                )
        return {label: int(architecture[label]) for label in self.labels}

    def reachable_labels(self, architecture: Mapping[str, int]) -> frozenset[str]:
        """The labels whose choice ``architecture``'s path reads.

        A label is unreachable when every choice and :class:`~.choice.When` carrying it sits inside a
        candidate the architecture did not pick (or the body of a ``When`` that does not run, e.g. the
        op of an edge a cell's node did not choose); changing it changes nothing the subnet runs.
        """
        reached: set[str] = set()
        for root in self._scopes:
            for scope in root.active(architecture):
                reached.update(label for label, _, _ in scope.choices)
        return frozenset(reached)

    def canonical(self, architecture: Mapping[str, int]) -> Architecture:
        """The representative of the architectures that run the same subnet as ``architecture``.

        Every label the path never reaches (:meth:`reachable_labels`) is set to 0, so two architectures
        that differ only there give the same dict; the reached labels, which alone decide which
        labels are reached, keep their choices. Searchers evaluate one architecture per canonical form.

        Raises:
            NASPipeConfigError: ``architecture`` is not one of this space's (see :meth:`validate`).
        """
        architecture = self.validate(architecture)
        reached = self.reachable_labels(architecture)
        return {label: value if label in reached else 0 for label, value in architecture.items()}

    def block_op(self, index: int, architecture: Mapping[str, int]) -> nn.Module:
        """The module block ``index`` runs for ``architecture``: a top-level choice's candidate, else
        the block itself (whose nested choices follow the active architecture, see :meth:`run_block`)."""
        block = self.blocks[index]
        if isinstance(block, ChoiceBlock):
            assert block.label is not None
            return block.candidates[architecture[block.label]]
        return block

    def run_block(self, index: int, x: object, architecture: Mapping[str, int]) -> object:
        """Block ``index`` of subnet ``architecture`` applied to ``x``."""
        with active_architecture(architecture):
            return self.blocks[index](x)

    def resources(self, blocks: Sequence[int], architecture: Mapping[str, int]) -> frozenset[Resource]:
        """All resources ``architecture`` uses in ``blocks``."""
        found: set[Resource] = set()
        for i in blocks:
            key = (i, tuple(architecture[label] for label in self._block_labels[i]))
            cached = self._cache.get(key)
            if cached is None:
                cached = self._cache[key] = frozenset(
                    self._key_of[s.path] for s in self._scopes[i].active(architecture) if s.path in self._key_of)
            found |= cached
        return frozenset(found)

    def stage_resources(self, blocks: Sequence[int]) -> dict[Resource, ResourceState]:
        """Every resource in ``blocks`` (whatever the subnet) and its tensors."""
        keys = {self._key_of[s.path] for i in blocks for s in self._scopes[i].walk() if s.path in self._key_of}
        return {key: self._states[key] for key in sorted(keys)}

    def resource_state(self, resource: Resource) -> ResourceState:
        """The parameters and buffer slots behind a resource key."""
        return self._states[resource]

    def resource_blocks(self, resource: Resource) -> list[int]:
        """The blocks whose scopes make up ``resource`` (several when a tensor is tied across blocks)."""
        return self._blocks_of[resource]

    def freeze(self, architecture: Mapping[str, int], reinitialize: bool = False) -> nn.Sequential:
        """A standalone copy of subnet ``architecture``: its blocks with the chosen weights only.

        Every choice is replaced by its chosen candidate (and every :class:`~.choice.When` by its body
        or by nothing), so it runs without an active architecture; weights tied within the subnet stay
        tied, and the supernet is left untouched. In eval mode its output equals
        ``self(x, architecture)`` bitwise. Save it with :func:`lightning_naspipe.save_subnet` for use
        without this library.

        Args:
            architecture: the subnet, ``dict[label, candidate index]``.
            reinitialize: reset every module's parameters (``reset_parameters``) to train the
                architecture from scratch, instead of keeping the supernet's trained weights.

        Returns:
            ``nn.Sequential`` of the blocks, in this supernet's train/eval mode.
        """
        return freeze(self, architecture, reinitialize)

    def forward(self, x: object, architecture: Mapping[str, int]) -> object:
        """Run the whole subnet ``architecture`` on ``x`` (no keyed randomness; for inference)."""
        architecture = self.validate(architecture)
        if self.local_blocks is not None:
            raise RuntimeError(
                f"This process runs pipeline stage blocks {self.local_blocks.start}..{self.local_blocks.stop - 1} "
                "only; the other blocks' weights live on other stages. Use self.subnet_output(batch, architecture) "
                "in validation and test steps: it runs the subnet through the pipeline."
            )
        for i in range(len(self.blocks)):
            x = self.run_block(i, x, architecture)
        return x


def supernet_of(module: object) -> Supernet:
    """``module.supernet``, or a clear error if the user did not set one."""
    supernet = getattr(module, "supernet", None)
    if not isinstance(supernet, Supernet):
        raise NASPipeConfigError(
            f"{type(module).__name__} has no supernet: set self.supernet = lightning_naspipe.Supernet(...) in "
            "__init__."
        )
    return supernet


def describe(value: BlockValue) -> str:
    """A value between blocks in short (for errors and the stage table): its structure, dtypes and shapes."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if value is None or isinstance(value, (int, float, str, bool)):
        return type(value).__name__
    if isinstance(value, (tuple, list)):
        parts: list[str] = []
        for item in value:
            text = describe(item)
            if parts and parts[-1].split(" x")[0] == text:
                count = int(parts[-1].split(" x")[1]) + 1 if " x" in parts[-1] else 2
                parts[-1] = f"{text} x{count}"
            else:
                parts.append(text)
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, dict):
        return "dict(" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + ")"
    leaves = pytree.tree_leaves(value)
    return f"{type(value).__name__}({len(leaves)} leaves)"
