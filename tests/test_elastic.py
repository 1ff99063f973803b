"""Elastic layers (space/elastic.py): choices over slices of one weight, frozen to smaller plain modules bitwise;
labels, sampling, resources, BatchNorm statistics; training with the mixin, plain and under the strategy."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.pipeline.sampling.keyed import uniform_architecture
from lightning_naspipe.space.choice import active_architecture
from tests.helpers import FEATURES, assert_same_state, full_state, pl, toy_loader, train

WIDTHS = [4, 8, 12]


def conv_space(kernel_transform: bool = False) -> lnp.Supernet:
    """Conv (elastic width and kernel) + its BatchNorm, a depthwise conv following the width, a 1x1 conv back."""
    return lnp.Supernet(
        nn.Sequential(lnp.ElasticConv2d(3, WIDTHS, [3, 5, 7], label="w", kernel_label="k",
                                        kernel_transform=kernel_transform),
                      lnp.ElasticBatchNorm2d(WIDTHS, label="w"), nn.ReLU()),
        nn.Sequential(lnp.ElasticConv2d(WIDTHS, WIDTHS, [3, 5], 2, depthwise=True, in_label="w"),
                      lnp.ElasticBatchNorm2d(WIDTHS, label="w", momentum=None)),
        lnp.ElasticConv2d(WIDTHS, 6, 1, in_label="w", bias=False),
    )


def linear_space() -> lnp.Supernet:
    """Linear (elastic width) + BatchNorm1d sharing its label, then a linear whose input follows it."""
    return lnp.Supernet(
        lnp.ElasticLinear(FEATURES, WIDTHS, label="w"),
        nn.Sequential(lnp.ElasticBatchNorm1d(WIDTHS, label="w"), nn.ReLU()),
        lnp.ChoiceBlock([lnp.ElasticLinear(WIDTHS, [3, 6], in_label="w"), lnp.ElasticLinear(WIDTHS, 6, in_label="w")]),
    )


def architectures(supernet: lnp.Supernet) -> list[dict[str, int]]:
    labels, counts = list(supernet.labels), list(supernet.labels.values())
    return [dict(zip(labels, values)) for values in itertools.product(*(range(n) for n in counts))]


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("space", [conv_space, lambda: conv_space(kernel_transform=True), linear_space],
                         ids=["conv", "conv-transform", "linear"])
def test_frozen_subnet_is_smaller_and_bitwise_equal_to_the_supernet(space: Any, training: bool) -> None:
    torch.manual_seed(0)
    supernet = space()
    if any(isinstance(m, nn.ParameterDict) for m in supernet.modules()):  # transforms away from the identity
        with torch.no_grad():
            for name, p in supernet.named_parameters():
                if "transforms" in name:
                    p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(4, 3, 9, 9) if space is not linear_space else torch.randn(5, FEATURES)
    supernet.train(training)
    largest = max(parameter_count(supernet.freeze(a)) for a in architectures(supernet))
    assert largest <= parameter_count(supernet)
    for arch in architectures(supernet):
        frozen = supernet.freeze(arch)
        assert frozen.training == training
        assert not any(isinstance(m, lnp.Elastic) for m in frozen.modules())
        state = {k: v.clone() for k, v in supernet.state_dict().items()}
        out = supernet(x, arch)
        frozen_out = frozen(x)
        assert torch.equal(out, frozen_out), arch
        if training:  # both updated their statistics alike: the frozen one equals the supernet's leading channels
            for name, buffer in frozen.state_dict().items():
                if "running" in name:
                    full = supernet.state_dict()[f"blocks.{name}"]
                    assert torch.equal(full[:len(buffer)], buffer), name
                    assert torch.equal(full[len(buffer):], state[f"blocks.{name}"][len(buffer):]), name
    smallest = supernet.freeze({label: 0 for label in supernet.labels})
    biggest = supernet.freeze({label: count - 1 for label, count in supernet.labels.items()})
    assert parameter_count(smallest) < parameter_count(biggest) == largest


def test_frozen_weights_are_copies_not_views_and_train_alone() -> None:
    supernet = linear_space()
    frozen = supernet.freeze({"w": 0, "block2": 0, "block2.candidates.0.width": 0})
    linear = frozen[0]
    assert type(linear) is nn.Linear and linear.weight.shape == (4, FEATURES)
    assert linear.weight.untyped_storage().nbytes() == linear.weight.numel() * 4  # not the full weight's storage
    before = supernet.blocks[0].weight.detach().clone()
    frozen(torch.randn(3, FEATURES)).sum().backward()
    assert linear.weight.grad is not None and torch.equal(supernet.blocks[0].weight, before)


def test_frozen_subnet_saves_and_loads_bitwise(tmp_path: Any) -> None:
    torch.manual_seed(1)
    supernet = conv_space().eval()
    arch = {"w": 1, "k": 0, "block1.0.kernel": 1}
    x = torch.randn(2, 3, 8, 8)
    folder = lnp.save_subnet(supernet.freeze(arch), tmp_path / "subnet", x)
    assert torch.equal(lnp.load_subnet(folder)(x), supernet(x, arch))


def test_labels_are_choices_the_sampler_samples_and_validate_checks() -> None:
    supernet = conv_space()
    assert supernet.labels == {"w": 3, "k": 3, "block1.0.kernel": 2}
    seen = {label: {uniform_architecture(supernet.labels, 3, i)[label] for i in range(60)} for label in supernet.labels}
    assert seen == {label: set(range(count)) for label, count in supernet.labels.items()}
    with pytest.raises(lnp.NASPipeConfigError, match="3 candidates"):
        supernet.validate({"w": 3, "k": 0, "block1.0.kernel": 0})
    assert supernet.canonical({"w": 2, "k": 1, "block1.0.kernel": 1}) == {"w": 2, "k": 1, "block1.0.kernel": 1}


def test_an_elastic_choice_inside_an_unchosen_candidate_is_unreachable() -> None:
    supernet = linear_space()
    arch = {"w": 1, "block2": 1, "block2.candidates.0.width": 1}
    assert "block2.candidates.0.width" not in supernet.reachable_labels(arch)
    assert supernet.canonical(arch)["block2.candidates.0.width"] == 0


def test_shared_labels_need_equal_counts() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="different candidate counts"):
        lnp.Supernet(lnp.ElasticLinear(4, [2, 4], label="w"), lnp.ElasticBatchNorm1d([2, 3, 4], label="w"))


def test_candidates_share_one_resource() -> None:
    supernet = conv_space()
    keys = {supernet.resources(range(len(supernet)), a) for a in architectures(supernet)}
    assert keys == {frozenset({(0, -1), (1, -1), (2, -1)})}  # every subnet uses every block's one resource
    state = supernet.resource_state((0, -1))
    conv, norm = supernet.blocks[0][0], supernet.blocks[0][1]
    assert {id(p) for p in state.params} == {id(conv.weight), id(conv.bias), id(norm.weight), id(norm.bias)}
    assert {name for _, name in state.buffers} == {"running_mean", "running_var", "num_batches_tracked"}
    inside = linear_space()  # inside a choice's candidate: that candidate's resource
    assert inside.resources([2], {"w": 0, "block2": 0, "block2.candidates.0.width": 1}) == {(2, 0)}
    assert inside.resources([2], {"w": 0, "block2": 1, "block2.candidates.0.width": 1}) == {(2, 1)}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_updates_exactly_the_leading_statistics_as_a_plain_batchnorm(momentum: float | None) -> None:
    torch.manual_seed(2)
    elastic = lnp.ElasticBatchNorm2d(WIDTHS, label="w", momentum=momentum)
    with torch.no_grad():
        elastic.running_mean.normal_()  # type: ignore[union-attr]
        elastic.running_var.uniform_(0.5, 2)  # type: ignore[union-attr]
        elastic.weight.normal_()  # type: ignore[union-attr]
    for choice, width in enumerate(WIDTHS):
        before = {k: v.clone() for k, v in elastic.state_dict().items()}
        plain = nn.BatchNorm2d(width, momentum=momentum)
        plain.load_state_dict({k: v[:width] if v.dim() else v for k, v in before.items()})
        x = torch.randn(5, width, 3, 3)
        with active_architecture({"w": choice}):
            out = elastic(x)
        assert torch.equal(out, plain(x))
        after = elastic.state_dict()
        for name in ("running_mean", "running_var"):
            assert torch.equal(after[name][:width], plain.state_dict()[name])
            assert torch.equal(after[name][width:], before[name][width:])
        assert int(after["num_batches_tracked"]) == int(before["num_batches_tracked"]) + 1
    elastic.eval()
    with active_architecture({"w": 0}):
        assert torch.equal(elastic(x[:, :4]), elastic.freeze_choice({"w": 0}).eval()(x[:, :4]))


def test_a_mismatched_input_width_names_the_label() -> None:
    layer = lnp.ElasticLinear(WIDTHS, 2, in_label="w")
    with active_architecture({"w": 0}), pytest.raises(RuntimeError, match="in_label"):
        layer(torch.randn(2, 8))


@pytest.mark.parametrize("arguments, match", [
    (dict(in_features=[2, 4], out_features=3), "in_label"),
    (dict(in_features=4, out_features=[]), "non-empty"),
    (dict(in_features=4, out_features=[0, 2]), ">= 1"),
    (dict(in_features=4, out_features=3, label="w"), "fixed size"),
])
def test_invalid_linear_arguments_are_refused(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match=match):
        lnp.ElasticLinear(**arguments)


def test_invalid_conv_arguments_are_refused() -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="odd"):
        lnp.ElasticConv2d(3, 4, [3, 4])
    with pytest.raises(lnp.NASPipeConfigError, match="depthwise"):
        lnp.ElasticConv2d(WIDTHS, 5, 3, depthwise=True, in_label="w")


def test_kernel_transform_starts_as_the_centre_crop() -> None:
    torch.manual_seed(3)
    plain, transformed = lnp.ElasticConv2d(3, 4, [3, 5, 7]), lnp.ElasticConv2d(3, 4, [3, 5, 7], kernel_transform=True)
    transformed.load_state_dict(plain.state_dict(), strict=False)
    assert transformed.transforms is not None and sorted(transformed.transforms) == ["5to3", "7to5"]
    lnp.Supernet(plain, transformed)
    x = torch.randn(1, 3, 6, 6)
    for k in range(3):
        with active_architecture({"block0.kernel": k, "block1.kernel": k}):
            assert torch.allclose(plain(x), transformed(x), atol=1e-6)


# -- training with the mixin ------------------------------------------------------------------------


class ElasticBody(lnp.NASPipeMixin):
    """A tiny elastic space: elastic widths with a coupled BatchNorm, an elastic head input; SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: dict[int, torch.Tensor] = {}
        self.supernet = linear_space()

    def compute_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1] % output.shape[1])

    def on_train_subnet_end(self, index: int, architecture: dict[str, int], loss: torch.Tensor) -> None:
        self.losses[index] = loss.clone()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ElasticNet(ElasticBody, pl.LightningModule):
    """ElasticBody on the tests' namespace."""


@pytest.fixture(scope="module")
def plain_run() -> dict[str, Any]:
    model, trainer = train(model_cls=ElasticNet, max_steps=16, max_epochs=-1, limit_val_batches=0)
    return full_state(model, trainer)


def test_plain_training_is_reproducible_and_trains(plain_run: dict[str, Any]) -> None:
    model, trainer = train(model_cls=ElasticNet, max_steps=16, max_epochs=-1, limit_val_batches=0)
    assert_same_state(plain_run, full_state(model, trainer))
    assert len(plain_run["losses"]) == 16
    pl.seed_everything(7, verbose=False)  # train()'s seed: the initial weights
    initial = ElasticNet().supernet.blocks[0].weight
    trained = plain_run["model"]["supernet.blocks.0.weight"]
    assert not torch.equal(initial[:4], trained[:4])  # every width trains the leading rows
    assert int(plain_run["model"]["supernet.blocks.1.0.num_batches_tracked"]) == 16


def test_the_strategy_equals_the_plain_trainer_bitwise(plain_run: dict[str, Any]) -> None:
    model, trainer = train(lnp.NASPipeStrategy(window=4), model_cls=ElasticNet, max_steps=16, max_epochs=-1,
                           limit_val_batches=0)
    assert_same_state(plain_run, full_state(model, trainer))


def test_search_and_export_after_training() -> None:
    model, trainer = train(model_cls=ElasticNet, max_steps=8, max_epochs=-1, limit_val_batches=0)
    loader = toy_loader(samples=16, shuffle=False)
    result = lnp.search(trainer, model, lnp.GridSearch(), loader)
    params = {tuple(r.architecture.values()): r.params for r in result.history}
    assert len(set(params.values())) > 1  # widths change the exported parameter count
    for record in result.history:
        assert record.params == parameter_count(model.supernet.freeze(record.architecture))


def test_the_timed_split_runs_elastic_blocks() -> None:
    from lightning_naspipe.planning.block_timing import timed_block_weights

    weights = timed_block_weights(conv_space(), torch.randn(2, 3, 8, 8), repeats=1)
    assert len(weights) == 3 and all(w > 0 for w in weights)


def test_a_width_mismatch_names_the_module_path_its_labels_and_the_active_sizes() -> None:
    space = lnp.Supernet(nn.Sequential(lnp.ElasticLinear(4, [20, 40], label="w1"), nn.ReLU()),
                         nn.Sequential(nn.Identity(), lnp.ElasticLinear([20, 40], [8, 16], in_label="w1", label="w2")))
    fc = space.blocks[1][1]
    assert fc.supernet_path == "supernet.blocks.1.1"  # the state dict's prefix under the module's self.supernet
    with pytest.raises(RuntimeError) as error:
        space.run_block(1, torch.randn(2, 32), {"w1": 1, "w2": 1})
    assert str(error.value).startswith(
        "ElasticLinear at supernet.blocks.1.1 (in 40 of (20, 40), label 'w1'; width 16 of (8, 16), label 'w2') "
        "expects 40 input features under this architecture, got 32. Its input width follows the in_label")


def test_a_shape_error_torch_raises_inside_names_the_module_and_keeps_the_cause() -> None:
    space = conv_space()
    with pytest.raises(RuntimeError) as error:
        space.run_block(0, torch.randn(1, 3, 2, 8, 8), {"w": 2, "k": 0})  # 5-d: conv2d refuses it
    assert str(error.value).startswith("ElasticConv2d at supernet.blocks.0.0 (width 12 of (4, 8, 12), label 'w'; "
                                       "kernel 3 of (3, 5, 7), label 'k'): ")
    assert type(error.value.__cause__) is RuntimeError and str(error.value.__cause__) in str(error.value)
    # Not a shape error (out of memory, NotImplementedError): raised as it is.
    layer = space.blocks[0][0]
    with pytest.raises(NotImplementedError, match="^no kernel$"):
        try:
            raise NotImplementedError("no kernel")
        except RuntimeError as raised:
            layer.raise_located(raised)


def test_a_batchnorm_of_the_wrong_dimension_and_a_module_outside_a_supernet_name_what_they_can() -> None:
    space = conv_space()
    with active_architecture({"w": 0, "k": 0}), pytest.raises(ValueError, match=re.escape(
            "ElasticBatchNorm2d at supernet.blocks.0.1 (width 4 of (4, 8, 12), label 'w') expects 4-d input, got 2-d")):
        space.blocks[0][1](torch.randn(2, 4))
    alone = lnp.ElasticLinear(4, [2, 3], label="w")  # no supernet: no path, labels and sizes still
    with active_architecture({"w": 1}), pytest.raises(RuntimeError, match=re.escape(
            "ElasticLinear (width 3 of (2, 3), label 'w') expects 4 input features")):
        alone(torch.randn(2, 5))
