"""Cells: outputs equal hand-written DAG computations; resources hold exactly the chosen edges' ops."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn

import lightning_naspipe as lnp
from helpers import EXAMPLES, QUIET, load_example
from lightning_naspipe.space.cells import Cell, Zero
from lightning_naspipe.errors import NASPipeConfigError

torch.set_num_threads(1)  # the conftest fixture pins it per test too; this covers module-level work

C = 4
NB201 = ("none", "skip", "conv1x1", "conv3x3", "avgpool")
NB201_EDGES = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


def nb201_op(i: int, j: int) -> lnp.ChoiceBlock:
    return lnp.ChoiceBlock({
        "none": Zero(),
        "skip": nn.Identity(),
        "conv1x1": nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 1, bias=False), nn.BatchNorm2d(C)),
        "conv3x3": nn.Sequential(nn.ReLU(), nn.Conv2d(C, C, 3, padding=1, bias=False), nn.BatchNorm2d(C)),
        "avgpool": nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
    }, label=f"e{i}{j}")


def darts_op(i: int, j: int) -> lnp.ChoiceBlock:
    # Every op but "skip" and "none" owns parameters, so resources tell chosen edges apart.
    return lnp.ChoiceBlock({"conv1": nn.Conv2d(C, C, 1), "conv3": nn.Conv2d(C, C, 3, padding=1),
                            "skip": nn.Identity(), "none": Zero()}, label=f"d{i}{j}")


def chosen(cell: Cell, i: int, j: int, arch: dict[str, int]) -> nn.Module:
    op = cell.edge_op(i, j)
    assert isinstance(op, lnp.ChoiceBlock) and op.label is not None
    return op.candidates[arch[op.label]]


def nb201_by_hand(cell: Cell, x: Tensor, arch: dict[str, int]) -> Tensor:
    def e(i: int, j: int, s: Tensor) -> Tensor:
        out = chosen(cell, i, j, arch)(s)
        assert isinstance(out, Tensor)
        return out

    s1 = e(0, 1, x)
    s2 = e(0, 2, x) + e(1, 2, s1)
    return e(0, 3, x) + e(1, 3, s1) + e(2, 3, s2)


def nb201_architectures(count: int) -> list[dict[str, int]]:
    generator = torch.Generator().manual_seed(1)
    return [{f"e{i}{j}": int(torch.randint(5, (), generator=generator)) for i, j in NB201_EDGES}
            for _ in range(count)]


def test_nb201_cell_equals_hand_computation() -> None:
    torch.manual_seed(0)
    cell = Cell(4, nb201_op)
    supernet = lnp.Supernet(cell)
    assert len(supernet) == 1 + 6 + 1  # entry, one block per edge, exit: the pipeline may cut inside
    assert supernet.labels == {f"e{i}{j}": 5 for i, j in NB201_EDGES}
    x = torch.randn(3, C, 6, 6)
    architectures = nb201_architectures(12) + [{label: 3 for label in supernet.labels}]
    for arch in architectures:
        assert torch.equal(supernet(x, arch), nb201_by_hand(cell, x, arch)), arch


def test_zero_op_contributes_zeros() -> None:
    torch.manual_seed(0)
    supernet = lnp.Supernet(Cell(4, nb201_op))
    x = torch.randn(2, C, 5, 5)
    none, skip = NB201.index("none"), NB201.index("skip")
    assert torch.equal(supernet(x, {label: none for label in supernet.labels}), torch.zeros_like(x))
    # Only e01 and e13 skip: s1 = x, s3 = 0 + s1 + 0.
    arch = {label: none for label in supernet.labels} | {"e01": skip, "e13": skip}
    assert torch.equal(supernet(x, arch), x)
    assert Zero(stride=2)(torch.ones(2, 3, 5, 5)).shape == (2, 3, 3, 3)
    assert not list(Zero().parameters())


def test_labels_are_shared_across_cells_weights_are_not() -> None:
    torch.manual_seed(0)
    first, second = Cell(4, nb201_op), Cell(4, nb201_op)
    supernet = lnp.Supernet(nn.Conv2d(1, C, 3, padding=1), first, second, nn.Flatten())
    assert list(supernet.labels) == [f"e{i}{j}" for i, j in NB201_EDGES]  # one decision per edge for both
    assert first.edge_op(0, 1) is not second.edge_op(0, 1)
    assert not {id(p) for p in first.parameters()} & {id(p) for p in second.parameters()}
    x = torch.randn(2, 1, 6, 6)
    for arch in nb201_architectures(6):
        stem = supernet.blocks[0](x)
        expected = nb201_by_hand(second, nb201_by_hand(first, stem, arch), arch).flatten(1)
        assert torch.equal(supernet(x, arch), expected)


def darts_architectures(supernet: lnp.Supernet, count: int) -> list[dict[str, int]]:
    generator = torch.Generator().manual_seed(2)
    return [{label: int(torch.randint(n, (), generator=generator)) for label, n in supernet.labels.items()}
            for _ in range(count)]


def test_darts_cell_chooses_two_inputs_per_node() -> None:
    torch.manual_seed(0)
    cell = Cell(6, darts_op, inputs=2, choose=2, output="concat", prefix="normal_")
    supernet = lnp.Supernet(cell)
    assert supernet.labels["normal_n2_inputs"] == 1 and supernet.labels["normal_n5_inputs"] == 10  # comb(5, 2)
    s0, s1 = torch.randn(2, C, 5, 5), torch.randn(2, C, 5, 5)
    every_block = range(len(supernet))
    for arch in darts_architectures(supernet, 16):
        states = [s0, s1]
        used: set[int] = set()
        for j in range(2, 6):
            a, b = list(itertools.combinations(range(j), 2))[arch[f"normal_n{j}_inputs"]]
            op_a, op_b = chosen(cell, a, j, arch), chosen(cell, b, j, arch)
            states.append(op_a(states[a]) + op_b(states[b]))
            used |= {id(p) for p in [*op_a.parameters(), *op_b.parameters()]}
        assert torch.equal(supernet((s0, s1), arch), torch.cat(states[2:], dim=1))
        # Exactly the chosen edges' chosen ops are resources; unchosen edges' ops are absent.
        resources = supernet.resources(every_block, arch)
        found = {id(p) for r in resources for p in supernet.resource_state(r).params}
        assert found == used, arch


def test_darts_cells_chain_and_keep_their_own_labels() -> None:
    torch.manual_seed(0)

    def reduce_op(i: int, j: int) -> lnp.ChoiceBlock:
        return lnp.ChoiceBlock({"skip": nn.Identity(), "none": Zero()}, label=f"r{i}{j}")

    pre = [nn.Conv2d(C, C, 1), nn.Conv2d(C, C, 1)]
    normal = Cell(4, darts_op, inputs=2, choose=2, output="concat", prefix="normal_", preprocess=pre, chain=True)
    reduce = Cell(4, reduce_op, inputs=2, choose=1, prefix="reduce_")
    supernet = lnp.Supernet(normal, _Shrink(), reduce)
    assert {"normal_n2_inputs", "normal_n3_inputs", "reduce_n2_inputs", "reduce_n3_inputs"} <= set(supernet.labels)
    s0, s1 = torch.randn(2, C, 4, 4), torch.randn(2, C, 4, 4)
    arch = {label: 0 for label in supernet.labels} | {"reduce_n3_inputs": 2}  # node 3 <- node 2, all skip
    # The chain hands on the raw s1 (before preprocess): reduce's node 2 picks input 0 = s1, node 3 = node 2.
    assert torch.equal(supernet((s0, s1), arch), s1)
    # Input 1 is the normal cell's node 2 = d02(pre0(s0)) + d12(pre1(s1)) (the only subset of 2 of 2).
    n2 = chosen(normal, 0, 2, arch)(pre[0](s0)) + chosen(normal, 1, 2, arch)(pre[1](s1))
    assert torch.equal(supernet((s0, s1), arch | {"reduce_n2_inputs": 1}), n2)


class _Shrink(nn.Module):
    """Between a chained DARTS cell and the next: keeps the first C channels of the concat."""

    def forward(self, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return state[0], state[1][:, :C]


def test_cell_nested_in_a_fixed_block() -> None:
    torch.manual_seed(0)
    cell = Cell(4, nb201_op)
    block = nn.Sequential(nn.Conv2d(1, C, 3, padding=1), cell)  # fixed: the pipeline cannot cut inside
    supernet = lnp.Supernet(block, nn.Flatten())
    assert len(supernet) == 2 and list(supernet.labels) == [f"e{i}{j}" for i, j in NB201_EDGES]
    x = torch.randn(2, 1, 6, 6)
    conv3x3 = NB201.index("conv3x3")
    for arch in nb201_architectures(6):
        assert torch.equal(supernet(x, arch), nb201_by_hand(cell, block[0](x), arch).flatten(1))
        found = {id(p) for r in supernet.resources(range(2), arch) for p in supernet.resource_state(r).params}
        expected = {id(p) for p in block[0].parameters()} | {
            id(p) for i, j in NB201_EDGES for p in chosen(cell, i, j, arch).parameters()}
        assert found == expected
    assert any(v == conv3x3 for arch in nb201_architectures(6) for v in arch.values())


def _cut(value: Any) -> Any:
    """What the next block receives: every tensor a fresh leaf (as at a pipeline boundary)."""
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_cut(v) for v in value)
    return value


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.requires_grad else []
    return [t for v in value for t in _tensors(v)] if isinstance(value, tuple) else []


def test_block_by_block_backward_matches_one_graph_and_skips_unchosen_edges() -> None:
    torch.manual_seed(0)
    cell = Cell(6, darts_op, inputs=2, choose=2, output="concat")
    supernet = lnp.Supernet(cell)
    s0, s1 = torch.randn(2, C, 5, 5, requires_grad=True), torch.randn(2, C, 5, 5, requires_grad=True)
    arch = darts_architectures(supernet, 1)[0]
    # Cut at every block boundary, then backward block by block, as the pipeline does.
    inputs, outputs = [], []
    value: Any = (s0, s1)
    for b in range(len(supernet)):
        inputs.append(_cut(value))
        value = supernet.run_block(b, inputs[-1], arch)
        outputs.append(value)
    grads: list[Tensor | None] = [torch.ones_like(value)]
    for b in reversed(range(len(supernet))):
        pairs = [(t, g) for t, g in zip(_tensors(outputs[b]), grads) if g is not None]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = [t.grad for t in _tensors(inputs[b])]
    cut_grads = {name: None if p.grad is None else p.grad.clone() for name, p in cell.named_parameters()}
    cut_input_grads = grads
    cell.zero_grad(set_to_none=True)
    from lightning_naspipe.space.choice import active_architecture

    with active_architecture(arch):
        out = cell((s0, s1))
    assert isinstance(out, Tensor)
    out.backward(torch.ones_like(out))
    used = {id(p) for r in supernet.resources(range(len(supernet)), arch)
            for p in supernet.resource_state(r).params}
    for name, p in cell.named_parameters():
        assert (p.grad is None) == (id(p) not in used), name  # unchosen edges' ops get no gradient
        if p.grad is not None:
            cut = cut_grads[name]
            assert cut is not None and torch.allclose(cut, p.grad), name
        else:
            assert cut_grads[name] is None, name
    for cut, whole in zip(cut_input_grads, [s0.grad, s1.grad]):
        assert cut is not None and whole is not None and torch.allclose(cut, whole)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(nodes=1), "nodes counts the input nodes too"),
    (dict(nodes=4, inputs=0), "inputs is the number of input nodes"),
    (dict(nodes=4, op=nn.Identity()), "must be a function op(i, j)"),
    (dict(nodes=4, op=lambda i, j: "conv"), "op(0, 1) returned a str"),
    (dict(nodes=6, inputs=2, choose=3), "between 1 and 2"),
    (dict(nodes=4, output="sum"), "output='last'"),
    (dict(nodes=4, prefix=3), "label prefix is a str"),
    (dict(nodes=6, inputs=2, preprocess=[nn.Identity()]), "one nn.Module per input (2)"),
    (dict(nodes=4, preprocess=nn.Identity()), "one nn.Module per input (1)"),
    (dict(nodes=4, choose=0), "between 1 and 1"),
    (dict(nodes=4, chain="yes"), "chain is True or False"),
])
def test_bad_arguments_say_what_to_write(kwargs: dict[str, Any], needle: str) -> None:
    kwargs.setdefault("op", nb201_op)
    nodes = kwargs.pop("nodes")
    with pytest.raises(NASPipeConfigError) as error:
        Cell(nodes, **kwargs)
    assert needle in str(error.value)
    with pytest.raises(NASPipeConfigError, match="stride is a whole number"):
        Zero(stride=0)


def test_wrong_input_value_is_explained() -> None:
    supernet = lnp.Supernet(Cell(6, darts_op, inputs=2, choose=2))
    arch = {label: 0 for label in supernet.labels}
    with pytest.raises(NASPipeConfigError, match=r"takes a tuple of 2 tensors, got float32\[2, "):
        supernet(torch.randn(2, C, 4, 4), arch)


def test_node_without_input_is_explained() -> None:
    def silent(i: int, j: int) -> nn.Module:
        return lnp.ChoiceBlock([_Nothing(), nn.Identity()], label=f"e{i}{j}")

    supernet = lnp.Supernet(Cell(3, silent))
    x = torch.randn(2, 3)
    assert torch.equal(supernet(x, {"e01": 1, "e02": 0, "e12": 1}), x)  # None contributes nothing
    with pytest.raises(RuntimeError, match="Cell node 1 got no input"):
        supernet(x, {"e01": 0, "e02": 1, "e12": 1})


class _Nothing(nn.Module):
    def forward(self, x: Tensor) -> None:
        return None


# -- the NB201 example -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nb201() -> ModuleType:
    return load_example("nb201_digits")


def test_nb201_example_shipped_config_learns(nb201: ModuleType, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["nb201_digits.py"])  # LightningCLI warns about pytest's own argv
    cli = nb201.cli_main(["fit", "--config", str(EXAMPLES / "nb201.yaml"), "--trainer.max_steps", "46",
                          "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert isinstance(cli.trainer.strategy, lnp.NASPipeStrategy)
    assert len(cli.model.supernet) == 19  # stem, 8 blocks per cell, reduction, head
    assert list(cli.model.supernet.labels) == [f"e{i}{j}" for i, j in NB201_EDGES]
    assert cli.trainer.global_step == 46
    assert float(cli.trainer.callback_metrics["val_acc"]) > 0.2  # two epochs; chance is 0.1


def test_nb201_example_naspipe_matches_plain_trainer(nb201: ModuleType) -> None:
    states = []
    for strategy in ("auto", lnp.NASPipeStrategy(window=4)):
        pl.seed_everything(42, verbose=False)
        model = nb201.NB201Supernet(channels=4)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=12, limit_val_batches=0,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             logger=False)
        trainer.fit(model, nb201.DigitsDataModule())
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
