"""A space's fingerprint (what a checkpoint records of its space) and the differences named on resume."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.space.fingerprint import FORMAT, space_changes, space_fingerprint


def _space(ops: dict[str, nn.Module] | None = None, heads: tuple[int, ...] = (2, 4), blocks: int = 0,
           label: str | None = None) -> lnp.Supernet:
    ops = ops if ops is not None else {"conv3": nn.Linear(8, 8), "conv5": nn.Linear(8, 8)}
    return lnp.Supernet(nn.Linear(4, 8), lnp.ChoiceBlock(ops, label=label),
                        lnp.ChoiceBlock([nn.ReLU(), nn.Tanh()]),
                        nn.Sequential(nn.LayerNorm(8), lnp.ElasticAttention(8, list(heads), 4, label="heads")),
                        *[nn.Identity() for _ in range(blocks)])


def test_the_fingerprint_records_blocks_labels_candidates_and_elastic_sizes_in_plain_values(tmp_path: Path) -> None:
    fingerprint = space_fingerprint(_space())
    assert fingerprint == {
        "format": FORMAT, "blocks": 4, "labels": [["block1", 2], ["block2", 2], ["heads", 2]],
        "choices": [["blocks.1", "block1", [["conv3", "Linear"], ["conv5", "Linear"]]],
                    ["blocks.2", "block2", [["0", "ReLU"], ["1", "Tanh"]]]],
        "elastic": [["blocks.3.1", "heads", "heads", [2, 4]]]}
    # Plain lists, strings and ints: it survives torch.load(weights_only=True) as it was.
    torch.save({"naspipe": {"space": fingerprint}}, tmp_path / "space.ckpt")
    assert torch.load(tmp_path / "space.ckpt", weights_only=True)["naspipe"]["space"] == fingerprint


def test_equal_spaces_have_no_changes_whatever_their_weights() -> None:
    torch.manual_seed(0)
    first = space_fingerprint(_space())
    torch.manual_seed(1)
    assert space_changes(first, space_fingerprint(_space())) == []


def test_another_candidate_and_another_head_count_are_named_as_they_were_and_are() -> None:
    old = space_fingerprint(_space())
    new = space_fingerprint(_space({"conv3": nn.Linear(8, 8), "conv5": nn.Linear(8, 8), "skip": nn.Identity()},
                                   heads=(1, 2, 4)))
    assert space_changes(old, new) == [
        "choice 'block1' (blocks.1) had candidates [conv3 (Linear), conv5 (Linear)] in the checkpoint, now "
        "[conv3 (Linear), conv5 (Linear), skip (Identity)]",
        "elastic 'heads' (blocks.3.1, heads) sizes (2, 4) -> (1, 2, 4)"]


def test_a_candidates_class_counts_and_a_list_choice_is_named_by_its_classes() -> None:
    old = space_fingerprint(lnp.Supernet(lnp.ChoiceBlock([nn.ReLU(), nn.Tanh()])))
    new = space_fingerprint(lnp.Supernet(lnp.ChoiceBlock([nn.ReLU(), nn.GELU()])))
    assert space_changes(old, new) == [
        "choice 'block0' (blocks.0) had candidates [ReLU, Tanh] in the checkpoint, now [ReLU, GELU]"]


def test_blocks_labels_and_choices_that_came_or_went_are_named() -> None:
    old = space_fingerprint(_space())
    assert space_changes(old, space_fingerprint(_space(label="ops"))) == [
        "choice 'ops' (blocks.1) had label 'block1' in the checkpoint"]
    grown = space_fingerprint(lnp.Supernet(*_space().blocks, lnp.ChoiceBlock([nn.ReLU(), nn.Tanh()])))
    assert space_changes(old, grown) == [
        "the supernet had 4 blocks in the checkpoint, now 5",
        "choice 'block4' (blocks.4) [ReLU, Tanh] is not in the checkpoint's space"]
    assert space_changes(grown, old)[1] == ("the checkpoint's space has choice 'block4' (blocks.4) [ReLU, Tanh], this "
                                            "one has none there")


def test_labels_in_another_order_are_named_since_the_sampler_draws_other_subnets() -> None:
    old = space_fingerprint(_space())
    reordered = dict(old, labels=[old["labels"][1], old["labels"][0], old["labels"][2]])
    assert space_changes(old, reordered) == [
        "the labels (in the order the sampler draws them, with their candidate counts) were {'block1': 2, "
        "'block2': 2, 'heads': 2} in the checkpoint, now {'block2': 2, 'block1': 2, 'heads': 2}"]


def test_a_fingerprint_of_an_unknown_format_or_with_tuples_compares_sensibly() -> None:
    old = space_fingerprint(_space())
    assert space_changes({**old, "format": FORMAT + 1}, space_fingerprint(_space(heads=(4,)))) == []
    as_tuples = {**old, "elastic": [tuple(e[:3]) + (tuple(e[3]),) for e in old["elastic"]]}
    assert space_changes(as_tuples, old) == []
