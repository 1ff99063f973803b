"""The search space: an ordered sequence of blocks, some of them choices between candidate ops.

A *subnet* (architecture) is a ``dict[label, candidate index]``: one decision per label. Blocks
that share a label share one decision, so a label must name blocks with equal candidate counts.

A *resource* is something two subnets must not use at the same time on one stage without
ordering (the CSP rule): a module holding trainable parameters or buffers. Parameter- and
buffer-free modules (``nn.Identity``, pooling, activations) are no resource and conflict with
nothing. Resources are keyed by the first place a module object appears, so a module reused in
two places is one resource.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Union

from torch import nn

from lightning_naspipe.errors import NASPipeConfigError

Architecture = dict[str, int]
#: ``(block index, candidate index)``; candidate index is ``-1`` for a fixed block.
Resource = tuple[int, int]


class ChoiceBlock(nn.Module):
    """A block whose op is chosen per subnet among ``candidates``.

    Args:
        candidates: a non-empty list of modules, or a dict mapping names to modules (the
            candidate index is then the position in the dict's order).
        label: blocks sharing a label share one decision. Defaults to a label unique to this
            block (``"block{i}"`` by its position in the :class:`Supernet`).
    """

    def __init__(
        self,
        candidates: Union[Sequence[nn.Module], Mapping[str, nn.Module]],
        label: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(candidates, Mapping):
            names, modules = list(candidates.keys()), list(candidates.values())
        elif isinstance(candidates, Sequence) and not isinstance(candidates, (str, bytes)):
            modules = list(candidates)
            names = [str(i) for i in range(len(modules))]
        else:
            raise NASPipeConfigError(
                f"ChoiceBlock candidates must be a list or dict of nn.Module, got {type(candidates).__name__}."
            )
        if not modules:
            raise NASPipeConfigError(
                "ChoiceBlock got no candidates: pass at least one nn.Module, e.g. ChoiceBlock([nn.Identity()])."
            )
        for name, module in zip(names, modules):
            if not isinstance(module, nn.Module):
                raise NASPipeConfigError(
                    f"ChoiceBlock candidate {name!r} is a {type(module).__name__}, not an nn.Module."
                )
        if label is not None and not isinstance(label, str):
            raise NASPipeConfigError(f"ChoiceBlock label must be a str, got {type(label).__name__}.")
        self.candidate_names = names
        self.candidates = nn.ModuleList(modules)
        self.label = label

    def __len__(self) -> int:
        return len(self.candidates)

    def forward(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(
            "A ChoiceBlock has no forward of its own: run it through Supernet.forward(x, architecture)."
        )


class Supernet(nn.Module):
    """The supernet: ``blocks`` applied in order; each block's output feeds the next.

    Args:
        *blocks: plain ``nn.Module`` blocks (fixed, used by every subnet) or :class:`ChoiceBlock`.
    """

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        if len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
            blocks = tuple(blocks[0])
        if not blocks:
            raise NASPipeConfigError("Supernet needs at least one block: Supernet(block0, block1, ...).")
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module):
                raise NASPipeConfigError(f"Supernet block {i} is a {type(block).__name__}, not an nn.Module.")
        self.blocks = nn.ModuleList(blocks)
        self.labels: dict[str, int] = {}  # label -> candidate count, in first-appearance order
        for i, block in enumerate(blocks):
            if not isinstance(block, ChoiceBlock):
                continue
            if block.label is None:
                block.label = f"block{i}"
            count = self.labels.setdefault(block.label, len(block))
            if count != len(block):
                raise NASPipeConfigError(
                    f"Blocks sharing label {block.label!r} have different candidate counts ({count} and "
                    f"{len(block)} at block {i}); give them equal counts or different labels."
                )
        self._resource_of = self._index_resources()
        #: Set by a multi-stage strategy while this process's copy is current only for these blocks.
        self.local_blocks: range | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def _index_resources(self) -> dict[Resource, Resource]:
        """Map each ``(block, candidate)`` slot holding state to the slot where its module first appears."""
        first_seen: dict[int, Resource] = {}
        resource_of: dict[Resource, Resource] = {}
        for slot, module in self._slots():
            if not _has_state(module):
                continue
            resource_of[slot] = first_seen.setdefault(id(module), slot)
        return resource_of

    def _slots(self) -> Iterator[tuple[Resource, nn.Module]]:
        for i, block in enumerate(self.blocks):
            if isinstance(block, ChoiceBlock):
                for k, candidate in enumerate(block.candidates):
                    yield (i, k), candidate
            else:
                yield (i, -1), block

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

    def block_op(self, index: int, architecture: Mapping[str, int]) -> nn.Module:
        """The module block ``index`` runs for ``architecture``."""
        block = self.blocks[index]
        if isinstance(block, ChoiceBlock):
            assert block.label is not None
            return block.candidates[architecture[block.label]]
        return block

    def block_resource(self, index: int, architecture: Mapping[str, int]) -> Resource | None:
        """The resource block ``index`` uses for ``architecture``, or ``None`` if it holds no state."""
        block = self.blocks[index]
        if isinstance(block, ChoiceBlock):
            assert block.label is not None
            slot = (index, architecture[block.label])
        else:
            slot = (index, -1)
        return self._resource_of.get(slot)

    def resources(self, blocks: range, architecture: Mapping[str, int]) -> frozenset[Resource]:
        """All resources ``architecture`` uses in ``blocks``."""
        found = (self.block_resource(i, architecture) for i in blocks)
        return frozenset(r for r in found if r is not None)

    def stage_resources(self, blocks: range) -> dict[Resource, nn.Module]:
        """Every resource in ``blocks`` (whatever the subnet) and its module."""
        keys = {r for slot, r in self._resource_of.items() if slot[0] in blocks}
        return {r: self.resource_module(r) for r in sorted(keys)}

    def resource_module(self, resource: Resource) -> nn.Module:
        """The module behind a resource key."""
        block, candidate = resource
        module = self.blocks[block]
        return module.candidates[candidate] if isinstance(module, ChoiceBlock) else module

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
            x = self.block_op(i, architecture)(x)
        return x


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
