"""A search space's fingerprint: what a checkpoint records of the space it was trained on, and the differences.

Resuming a supernet into another space can load without a complaint: one more parameter-free candidate
(``nn.Identity``), or one more head count over the same projections (an :class:`~.elastic_blocks.ElasticAttention`
slices one weight), changes no tensor shape, yet every subnet sampled after it differs and the run trains
something else. The fingerprint holds what decides the space, in plain lists and strings (so that a checkpoint
loads with ``weights_only=True``): the number of blocks, the labels in order with their candidate counts (the
sampler draws from them in that order), each :class:`~.choice.ChoiceBlock`'s candidates (names and classes) and
each elastic dimension's sizes, by their path in the supernet. Weights are not in it: their shapes are the
state dict's to check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_naspipe.space.choice import ChoiceBlock, Elastic

__all__ = ["FORMAT", "space_changes", "space_fingerprint"]

#: The fingerprint's layout; a checkpoint with another is not compared (a later release may read older ones).
FORMAT = 1


def space_fingerprint(supernet: nn.Module) -> dict[str, Any]:
    """``supernet``'s fingerprint (see the module's docstring), a dict of plain values.

    Args:
        supernet: a :class:`~.supernet.Supernet`.

    Returns:
        ``{"format", "blocks", "labels": [[label, count]], "choices": [[path, label, [[name, class]]]],
        "elastic": [[path, dimension, label, [sizes]]]}``, paths as in ``supernet.named_modules()``.
    """
    choices: list[list[Any]] = []
    elastic: list[list[Any]] = []
    for path, module in supernet.named_modules():
        if isinstance(module, ChoiceBlock):
            candidates = [[name, type(op).__qualname__] for name, op in zip(module.candidate_names, module.candidates)]
            choices.append([path, module.label, candidates])
        if isinstance(module, Elastic):
            elastic += [[path, name, dim.label, list(dim.values)] for name, dim in module.dims.items()]
    labels = getattr(supernet, "labels", {})
    return {"format": FORMAT, "blocks": len(getattr(supernet, "blocks", ())),
            "labels": [[label, count] for label, count in labels.items()], "choices": choices, "elastic": elastic}


def space_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between the ``saved`` fingerprint (a checkpoint's) and the ``current`` one, one line each,
    e.g. ``"choice 'block3' (blocks.3) had candidates [conv3 (Conv2d), conv5 (Conv2d)] in the checkpoint, now
    [conv3 (Conv2d), conv5 (Conv2d), skip (Identity)]"`` or ``"elastic 'heads' (blocks.2.attention, heads) sizes
    (2, 4) -> (2, 4, 8)"``; empty when they are the same space, or when ``saved`` has a format this release does
    not know."""
    if saved.get("format") != FORMAT:
        return []
    changes: list[str] = []
    if saved["blocks"] != current["blocks"]:
        changes.append(f"the supernet had {saved['blocks']} blocks in the checkpoint, now {current['blocks']}")
    changes += _site_changes("choice", {c[0]: c for c in saved["choices"]}, {c[0]: c for c in current["choices"]})
    changes += _site_changes("elastic", {(e[0], e[1]): e for e in saved["elastic"]},
                             {(e[0], e[1]): e for e in current["elastic"]})
    if not changes and [list(x) for x in saved["labels"]] != [list(x) for x in current["labels"]]:
        # Same sites, other labels or order: the sampler draws other subnets.
        changes.append(f"the labels (in the order the sampler draws them, with their candidate counts) were "
                       f"{_labels(saved['labels'])} in the checkpoint, now {_labels(current['labels'])}")
    return changes


def _site_changes(kind: str, saved: dict[Any, list[Any]], current: dict[Any, list[Any]]) -> list[str]:
    changes = []
    for key in [*saved, *(k for k in current if k not in saved)]:
        old, new = saved.get(key), current.get(key)
        if old is not None and new is not None and _same(old, new):
            continue
        if new is None:
            assert old is not None
            changes.append(f"the checkpoint's space has {_site(kind, old)} {_what(kind, old)}, this one has none there")
        elif old is None:
            changes.append(f"{_site(kind, new)} {_what(kind, new)} is not in the checkpoint's space")
        elif old[-2] != new[-2]:  # the label
            changes.append(f"{_site(kind, new)} had label {old[-2]!r} in the checkpoint")
        elif kind == "choice":
            changes.append(f"{_site(kind, new)} had candidates {_what(kind, old)} in the checkpoint, now "
                           f"{_what(kind, new)}")
        else:
            changes.append(f"{_site(kind, new)} sizes {_what(kind, old)} -> {_what(kind, new)}")
    return changes


def _same(old: list[Any], new: list[Any]) -> bool:
    return bool(_plain(old) == _plain(new))


def _plain(value: Any) -> Any:
    """Lists for tuples, at any depth (a checkpoint may come back with either)."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _site(kind: str, entry: list[Any]) -> str:
    if kind == "choice":
        return f"choice {entry[1]!r} ({entry[0] or 'the supernet'})"
    return f"elastic {entry[2]!r} ({entry[0]}, {entry[1]})"


def _what(kind: str, entry: list[Any]) -> str:
    if kind == "elastic":
        return str(tuple(entry[3]))
    names = [(name, cls) for name, cls in entry[2]]
    default = all(name == str(i) for i, (name, _) in enumerate(names))  # a list's candidates: their classes say it
    return "[" + ", ".join(cls if default else f"{name} ({cls})" for name, cls in names) + "]"


def _labels(labels: list[Any]) -> str:
    return "{" + ", ".join(f"{label!r}: {count}" for label, count in labels) + "}"
