"""Choice primitives, usable at any depth inside a supernet block.

A :class:`ChoiceBlock` runs the candidate that the *active* subnet chooses for its label. The
active architecture is set by :meth:`Supernet.run_block <.supernet.Supernet.run_block>` around
each block's forward, so a ChoiceBlock may sit directly in the supernet's block list, inside a
fixed block (one transformer layer with a choice of attention and a choice of MLP), or inside
another choice's candidate. :class:`InputChoice` picks ``k`` of ``n`` inputs (DARTS-style cells,
NNI's ``InputChoice``); :class:`When` runs its body only for some choices of a label.
:class:`Elastic` is the base of choices whose candidates are slices of shared weights (elastic
width, kernel size, depth; see :mod:`.elastic`, :mod:`.elastic_blocks` and :mod:`.elastic_transformer`).

The resource walk (:func:`scope_of`) cuts a block's module tree at these primitives: every
*scope* (a block's fixed part, or one candidate's) owns the parameters and buffers reachable
from it without crossing into another choice. A subnet uses the scopes its choices reach.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NoReturn, Union

from torch import nn

from lightning_naspipe.compat.torch import module_buffers
from lightning_naspipe.errors import NASPipeConfigError

Architecture = dict[str, int]

_ACTIVE: ContextVar[Mapping[str, int] | None] = ContextVar("naspipe_active_architecture", default=None)


@contextlib.contextmanager
def active_architecture(architecture: Mapping[str, int]) -> Iterator[None]:
    """Within the body, choice primitives follow ``architecture``."""
    token = _ACTIVE.set(architecture)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class ChoiceBlock(nn.Module):
    """A block whose op is chosen per subnet among ``candidates``.

    Call it like the op it stands for; it runs the candidate the active subnet chooses. It may
    be a block of the :class:`~.supernet.Supernet`, or nested anywhere inside a block or inside
    another ChoiceBlock's candidate.

    Args:
        candidates: a non-empty list of modules, or a dict mapping names to modules (the
            candidate index is then the position in the dict's order).
        label: blocks sharing a label share one decision. Defaults to a label unique to this
            block (``"block{i}"`` by its position in the supernet, ``"block{i}.{path}"`` nested).
    """

    def __init__(
        self,
        candidates: Union[Sequence[nn.Module], Mapping[str, nn.Module]],
        label: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(candidates, Mapping):
            names, modules = [str(n) for n in candidates.keys()], list(candidates.values())
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

    def chosen_index(self) -> int:
        """The active subnet's choice for this block's label."""
        return _active_choice(self.label, type(self).__name__)

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.candidates[self.chosen_index()](*args, **kwargs)


def choice_counts(module: nn.Module) -> list[tuple[str, int]]:
    """The labels ``module`` itself decides by (not its children's) and their candidate counts: a
    :class:`ChoiceBlock`'s label, an :class:`Elastic` module's dimensions; nothing for other modules."""
    if isinstance(module, ChoiceBlock) and module.label is not None:
        return [(module.label, len(module))]
    if isinstance(module, Elastic):
        return [(dim.label, len(dim.values)) for dim in module.dims.values() if dim.label is not None]
    return []


def candidates_of(block: nn.Module) -> list[nn.Module]:
    """The ops a supernet block chooses among: a :class:`ChoiceBlock`'s candidates, else the block itself."""
    return list(block.candidates) if isinstance(block, ChoiceBlock) else [block]


class InputChoice(ChoiceBlock):
    """Chooses ``chosen`` of ``candidates`` inputs (like NNI's ``InputChoice``).

    Its label takes ``comb(candidates, chosen)`` values, one per subset in
    ``itertools.combinations`` order. Called on a sequence of ``candidates`` values, it returns
    the chosen ones as a tuple, in input order; :meth:`chosen_inputs` gives their indices.

    Args:
        candidates: how many inputs there are to choose from (n).
        chosen: how many of them a subnet uses (k), ``1 <= k <= n``.
        label: as for :class:`ChoiceBlock`.
    """

    def __init__(self, candidates: int, chosen: int = 1, label: str | None = None) -> None:
        if not isinstance(candidates, int) or not isinstance(chosen, int) or not 1 <= chosen <= candidates:
            raise NASPipeConfigError(
                f"InputChoice({candidates!r}, chosen={chosen!r}) needs whole numbers 1 <= chosen <= candidates."
            )
        self.subsets = list(itertools.combinations(range(candidates), chosen))
        super().__init__([_Pick(subset) for subset in self.subsets], label)
        self.candidate_names = ["+".join(map(str, subset)) for subset in self.subsets]
        self.num_inputs = candidates

    def chosen_inputs(self) -> tuple[int, ...]:
        """Indices of the inputs the active subnet uses."""
        return self.subsets[self.chosen_index()]

    def subsets_with(self, index: int) -> frozenset[int]:
        """The label values under which input ``index`` is used."""
        return frozenset(k for k, subset in enumerate(self.subsets) if index in subset)


class When(nn.Module):
    """Runs ``body`` only when the active subnet's choice for ``label`` is in ``values``.

    It marks conditional work (e.g. a DARTS edge whose input the node did not choose): the
    scheduler then counts ``body``'s parameters only for subnets that run it. Calling it when
    inactive returns ``None``.

    Args:
        body: the conditional module.
        label: the label whose choice decides.
        values: the choices of ``label`` under which ``body`` runs.
    """

    def __init__(self, body: nn.Module, label: str, values: frozenset[int]) -> None:
        super().__init__()
        self.body = body
        self.label = label
        self.values = frozenset(values)

    def is_active(self) -> bool:
        """Whether the active subnet runs ``body``."""
        return _active_choice(self.label, "When") in self.values

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.body(*args, **kwargs) if self.is_active() else None


@dataclass
class ElasticDim:
    """One elastic dimension of an :class:`Elastic` module: its candidate values and its label.

    Attributes:
        values: the sizes a subnet may choose (widths, kernel sizes, head counts, depths); the label's
            choice ``k`` picks ``values[k]``.
        label: the decision it follows; ``None`` until the :class:`~.supernet.Supernet` assigns one.
    """

    values: tuple[int, ...]
    label: str | None = None


class Elastic(nn.Module):
    """Base of choices whose candidates are slices of one module's shared weights.

    Each elastic dimension (:class:`ElasticDim`, e.g. ``"width"`` or ``"kernel"``) is a choice under a
    label, so the supernet registers, samples, validates and searches it like a :class:`ChoiceBlock`.
    Every choice uses the same tensors, so the module's tensors belong to the scope it sits in (a
    fixed block's, or a candidate's): all subnets through it share that one resource. A subclass
    reads its sizes with :meth:`value` in ``forward`` and builds the smaller standalone module of an
    architecture in :meth:`freeze_choice` (which :meth:`Supernet.freeze <.supernet.Supernet.freeze>`
    calls after freezing the module's children).
    """

    def __init__(self) -> None:
        super().__init__()
        self.dims: dict[str, ElasticDim] = {}
        #: Where it sits, e.g. ``"supernet.blocks.2.mlp.fc1"`` (the state dict's prefix under the module's
        #: ``self.supernet``); set when the :class:`~.supernet.Supernet` is built, for error messages.
        self.supernet_path: str | None = None

    def where(self) -> str:
        """This module for an error message: its class, its path in the supernet and its elastic dimensions'
        labels and sizes, the active one first while a subnet is active; computed only when an error is raised.

        Example: ``"ElasticLinear at supernet.blocks.2.fc1 (in 40 of (20, 40), label 'w1'; width 16 of (8, 16),
        label 'w2')"``.
        """
        architecture = _ACTIVE.get()
        dims = []
        for name, dim in self.dims.items():
            choice = architecture.get(dim.label) if architecture is not None and dim.label is not None else None
            active = f"{dim.values[choice]} of " if isinstance(choice, int) and 0 <= choice < len(dim.values) else ""
            dims.append(f"{name} {active}{dim.values}, label {dim.label!r}")
        path = self.__dict__.get("supernet_path")  # absent in a module pickled by an earlier release
        at = f" at {path}" if path else ""
        return f"{type(self).__name__}{at}" + (f" ({'; '.join(dims)})" if dims else "")

    def raise_located(self, error: RuntimeError) -> NoReturn:
        """Raise ``error``, a shape error torch raised in this module's forward, as a ``RuntimeError`` with
        :meth:`where` in front; any other kind (out of memory, ``NotImplementedError``) as it is. Called in an
        ``except`` clause, so the forward pays nothing until something fails."""
        if type(error) is not RuntimeError:
            raise error
        raise RuntimeError(f"{self.where()}: {error}") from error

    def add_dim(self, name: str, values: int | Sequence[int], label: str | None, minimum: int = 1) -> tuple[int, ...]:
        """Declare dimension ``name``: a whole number is a fixed size, a sequence an elastic one (a choice).

        Returns:
            The candidate values (one value when fixed).

        Raises:
            NASPipeConfigError: values not whole numbers ``>= minimum``, or a label for a fixed size.
        """
        what = f"{type(self).__name__}({name}={values!r})"
        elastic = not isinstance(values, int)
        options = tuple(values) if isinstance(values, Sequence) and not isinstance(values, (str, bytes)) else (
            (values,) if isinstance(values, int) else ())
        if not options or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in options):
            raise NASPipeConfigError(f"{what}: give a whole number >= {minimum} or a non-empty list of them, e.g. "
                                     f"{name}=[{max(minimum, 1)}, {max(minimum, 1) * 2}].")
        if label is not None and not isinstance(label, str):
            raise NASPipeConfigError(f"{what}: its label must be a str, got {type(label).__name__}.")
        if not elastic and label is not None:
            raise NASPipeConfigError(f"{what} is a fixed size, so it takes no label {label!r}; give a list of sizes "
                                     f"to make it elastic.")
        if elastic:
            self.dims[name] = ElasticDim(options, label)
        return options

    def set_label(self, name: str, label: str) -> None:
        """Give dimension ``name`` its label (the supernet does so for those left ``None``)."""
        self.dims[name].label = label

    def value(self, name: str, fixed: tuple[int, ...] = ()) -> int:
        """The active subnet's size along dimension ``name`` (``fixed[0]`` when it is not elastic)."""
        dim = self.dims.get(name)
        if dim is None:
            return fixed[0]
        return dim.values[_active_choice(dim.label, f"{type(self).__name__}'s {name}")]

    def value_in(self, name: str, architecture: Mapping[str, int], fixed: tuple[int, ...] = ()) -> int:
        """Dimension ``name``'s size in ``architecture`` (``fixed[0]`` when it is not elastic)."""
        dim = self.dims.get(name)
        if dim is None:
            return fixed[0]
        assert dim.label is not None, "labels are assigned when the Supernet is built"
        return dim.values[architecture[dim.label]]

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """A standalone module computing what this one computes under ``architecture``, with copies of the
        slices it uses (its children already frozen)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement freeze_choice")


class _Pick(nn.Module):
    """One candidate of an :class:`InputChoice`: selects a fixed subset of its inputs."""

    def __init__(self, subset: tuple[int, ...]) -> None:
        super().__init__()
        self.subset = subset

    def forward(self, inputs: Sequence[object]) -> tuple[object, ...]:
        return tuple(inputs[i] for i in self.subset)


def _active_choice(label: str | None, what: str) -> int:
    architecture = _ACTIVE.get()
    if architecture is None or label is None or label not in architecture:
        raise RuntimeError(
            f"A {what} (label {label!r}) runs the active subnet's choice, but none is active: run blocks through "
            "Supernet.forward(x, architecture) or Supernet.run_block, or wrap the call in "
            "lightning_naspipe.space.choice.active_architecture(architecture)."
        )
    return int(architecture[label])


# -- the resource walk -------------------------------------------------------------------------


@dataclass
class Scope:
    """A module subtree up to the next choice: what it owns, and the choices below it.

    Attributes:
        path: where it is: ``(block, -1)`` for a fixed block, ``(block, k)`` for candidate ``k``
            of a top-level choice; a nested scope appends ``(j, k)`` for candidate ``k`` of its
            parent's ``j``-th choice (``k == -1``: the body of a :class:`When`).
        params: the trainable and frozen parameters it owns, each once.
        buffers: ``(module, name)`` of every buffer slot it owns.
        choices: per nested choice: its label, the choice values that activate each child scope,
            and the child scopes. An :class:`Elastic` module's labels appear with no child scope: its
            tensors are this scope's whatever the choice, and the entry records that the label is read.
    """

    path: tuple[int, ...]
    params: list[nn.Parameter] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str]] = field(default_factory=list)
    choices: list[tuple[str, list[frozenset[int]], list[Scope]]] = field(default_factory=list)

    def tensor_ids(self) -> set[int]:
        """Identity of every tensor this scope owns."""
        return {id(p) for p in self.params} | {id(module_buffers(m)[n]) for m, n in self.buffers}

    def walk(self) -> Iterator[Scope]:
        """This scope and every scope below it."""
        yield self
        for _, _, children in self.choices:
            for child in children:
                yield from child.walk()

    def active(self, architecture: Mapping[str, int]) -> Iterator[Scope]:
        """This scope and the scopes below it that ``architecture`` reaches."""
        yield self
        for label, values, children in self.choices:
            choice = architecture[label]
            for when, child in zip(values, children):
                if choice in when:
                    yield from child.active(architecture)


def block_scope(index: int, block: nn.Module) -> Scope:
    """The scope tree of supernet block ``index``: rooted at ``(index, -1)`` for a fixed block; a
    top-level choice has an empty root ``(index,)`` whose candidates are ``(index, k)``."""
    if isinstance(block, (ChoiceBlock, When)):
        root = Scope((index,))
        _add_choice(root, block, lambda k: (index, k))
        return root
    return scope_of(block, (index, -1))


def scope_of(module: nn.Module, path: tuple[int, ...]) -> Scope:
    """The scope tree of ``module`` (see :class:`Scope`)."""
    scope = Scope(path)
    if isinstance(module, (ChoiceBlock, When)):  # a choice directly inside a choice
        _add_choice(scope, module, lambda k: (*path, 0, k))
    else:
        _fill(scope, module, set())
    return scope


def _add_choice(scope: Scope, choice: ChoiceBlock | When, path_of: Callable[[int], tuple[int, ...]]) -> None:
    assert choice.label is not None, "labels are assigned when the Supernet is built"
    if isinstance(choice, When):
        scope.choices.append((choice.label, [choice.values], [scope_of(choice.body, path_of(-1))]))
    else:
        children = [scope_of(c, path_of(k)) for k, c in enumerate(choice.candidates)]
        scope.choices.append((choice.label, [frozenset([k]) for k in range(len(choice))], children))


def _fill(scope: Scope, module: nn.Module, seen: set[int]) -> None:
    if id(module) in seen:
        return
    seen.add(id(module))
    if isinstance(module, Elastic):  # its labels are read here; its tensors are this scope's, whatever the choice
        scope.choices += [(dim.label, [], []) for dim in module.dims.values() if dim.label is not None]
    scope.params += [p for p in module.parameters(recurse=False) if all(p is not q for q in scope.params)]
    scope.buffers += [(module, n) for n, b in module_buffers(module).items() if b is not None]
    for child in module.children():
        if isinstance(child, (ChoiceBlock, When)):
            j = len(scope.choices)
            _add_choice(scope, child, lambda k, j=j: (*scope.path, j, k))  # type: ignore[misc]
        else:
            _fill(scope, child, seen)

