"""Elastic layers: linear and convolution layers and BatchNorm whose sizes are choices over one weight.

A candidate is a slice of the layer's largest weight (once-for-all, BigNAS): width ``w`` uses the
leading ``w`` output channels, kernel ``k`` the centre ``k x k`` of the largest kernel (or, with
``kernel_transform=True``, once-for-all's learned transform of it). A layer's input width is declared,
so that freezing needs nothing but the architecture: a whole number is a fixed width; a list of
widths with ``in_label`` follows the producing layer's choice (give it that layer's label), and the
layer reads the leading channels of its weight. Sharing a label couples choices: a convolution and
its BatchNorm take one width label::

    widths = [16, 32, 48]
    block = nn.Sequential(
        lnp.ElasticConv2d(3, widths, kernel_size=[3, 5], label="w1", kernel_label="k1"),
        lnp.ElasticBatchNorm2d(widths, label="w1"),
        nn.ReLU(),
        lnp.ElasticConv2d(widths, 10, kernel_size=1, in_label="w1"),
    )

Every choice reads the same tensors, so a layer is one resource with the scope it sits in. The
forward computes on contiguous copies of the slices, the very tensors
:meth:`~lightning_naspipe.space.choice.Elastic.freeze_choice` stores in the smaller plain module
(``nn.Linear``, ``nn.Conv2d``, ``nn.BatchNorm2d``), so the two give bitwise equal outputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, TypeVar, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.space.choice import Elastic

__all__ = ["ElasticBatchNorm1d", "ElasticBatchNorm2d", "ElasticConv2d", "ElasticLinear", "plain_copy"]

#: A size: a whole number (fixed) or the candidate sizes of an elastic dimension.
Sizes: TypeAlias = Union[int, Sequence[int]]
M = TypeVar("M", bound=nn.Module)


def plain_copy(cls: type[M], source: nn.Module, tensors: Mapping[str, Tensor | None], *args: Any,
               **kwargs: Any) -> M:
    """``cls(*args, **kwargs)``, built without initialising it (no global RNG draw), holding contiguous copies of
    ``tensors`` by name: a parameter slot gets a parameter that requires grad where ``source``'s parameter of
    that name does, a buffer slot a buffer."""
    device = kwargs.pop("device", None)
    module = cls(*args, device="meta", **kwargs).to_empty(device=device if device is not None else "cpu")
    slots, sources = dict(module.named_parameters(recurse=False)), dict(source.named_parameters(recurse=False))
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        copy = tensor.detach().clone(memory_format=torch.contiguous_format)
        if name in slots:
            own = sources.get(name)
            setattr(module, name, nn.Parameter(copy, requires_grad=own is None or own.requires_grad))
        else:
            setattr(module, name, copy)
    return module


def _input_dim(module: Elastic, values: Sizes, label: str | None) -> tuple[int, ...]:
    if not isinstance(values, int) and label is None:
        raise NASPipeConfigError(
            f"{type(module).__name__}: an elastic input width ({values!r}) follows the layer that produces it; pass "
            "in_label=<that layer's width label>, or a whole number for a fixed input width.")
    return module.add_dim("in", values, label)


def _check_width(module: Elastic, got: int, wanted: int, what: str) -> None:
    if got != wanted:
        raise RuntimeError(
            f"{module.where()} expects {wanted} {what} under this architecture, got {got}. Its input width "
            "follows the in_label (or the fixed width) it was given: give it the producing layer's label "
            "(a BatchNorm: the layer's width label).")


class ElasticLinear(Elastic):
    """A linear layer whose output width (and input width) are choices over one weight.

    Args:
        in_features: a fixed input width, or the input's candidate widths (with ``in_label``).
        out_features: a fixed output width, or candidate widths: choice ``k`` uses the leading
            ``out_features[k]`` rows of the weight.
        bias: whether it adds a bias.
        label: the output width's label (default: assigned by the supernet, ``"<path>.width"``).
        in_label: the label the input width follows (the producing layer's width label).
    """

    def __init__(self, in_features: Sizes, out_features: Sizes, bias: bool = True, label: str | None = None,
                 in_label: str | None = None) -> None:
        super().__init__()
        self.in_sizes = _input_dim(self, in_features, in_label)
        self.out_sizes = self.add_dim("width", out_features, label)
        self.weight = nn.Parameter(torch.empty(max(self.out_sizes), max(self.in_sizes)))
        self.bias = nn.Parameter(torch.empty(max(self.out_sizes))) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the largest weight."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.weight.shape[1])
            nn.init.uniform_(self.bias, -bound, bound)

    def _slices(self, inputs: int, outputs: int) -> tuple[Tensor, Tensor | None]:
        weight = self.weight[:outputs, :inputs].contiguous()
        return weight, None if self.bias is None else self.bias[:outputs].contiguous()

    def forward(self, x: Tensor) -> Tensor:
        inputs, outputs = self.value("in", self.in_sizes), self.value("width", self.out_sizes)
        _check_width(self, x.shape[-1], inputs, "input features")
        try:
            return F.linear(x, *self._slices(inputs, outputs))
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.Linear`` with the slices ``architecture`` uses."""
        inputs, outputs = self.value_in("in", architecture, self.in_sizes), self.value_in("width", architecture,
                                                                                          self.out_sizes)
        weight, bias = self._slices(inputs, outputs)
        return plain_copy(nn.Linear, self, {"weight": weight, "bias": bias}, inputs, outputs, bias=bias is not None,
                          device=weight.device, dtype=weight.dtype)


class ElasticConv2d(Elastic):
    """A 2-d convolution whose output width, input width and kernel size are choices over one weight.

    Padding keeps the spatial size at stride 1 (``kernel // 2``, odd kernels only).

    Args:
        in_channels: a fixed input width, or the input's candidate widths (with ``in_label``).
        out_channels: a fixed output width, or candidate widths (the leading output channels).
            Depthwise: equal to ``in_channels`` (the output follows the input).
        kernel_size: a fixed odd kernel size, or candidate sizes: kernel ``k`` is the centre ``k x k``
            of the largest kernel.
        stride: the convolution's stride.
        bias: whether it adds a bias.
        depthwise: one filter per channel (``groups`` = channels), as in MobileNet blocks.
        label: the output width's label (default ``"<path>.width"``; not for a depthwise layer).
        kernel_label: the kernel size's label (default ``"<path>.kernel"``).
        in_label: the label the input width follows.
        kernel_transform: once-for-all's kernel transformation: a smaller kernel is a learned linear map
            (one ``k*k x k*k`` matrix per step down, starting as the identity) of the centre of the next
            larger one, instead of the plain centre.
    """

    def __init__(self, in_channels: Sizes, out_channels: Sizes, kernel_size: Sizes, stride: int = 1, *,
                 bias: bool = True, depthwise: bool = False, label: str | None = None,
                 kernel_label: str | None = None, in_label: str | None = None, kernel_transform: bool = False) -> None:
        super().__init__()
        self.in_sizes = _input_dim(self, in_channels, in_label)
        if depthwise and (out_channels != in_channels or label is not None):
            raise NASPipeConfigError(
                f"ElasticConv2d(depthwise=True): the output follows the input, so out_channels must equal "
                f"in_channels ({in_channels!r}, got {out_channels!r}) and it takes no width label.")
        self.out_sizes = self.in_sizes if depthwise else self.add_dim("width", out_channels, label)
        self.kernel_sizes = self.add_dim("kernel", kernel_size, kernel_label)
        if any(k % 2 == 0 for k in self.kernel_sizes) or isinstance(stride, bool) or not isinstance(stride, int) \
                or stride < 1:
            raise NASPipeConfigError(f"ElasticConv2d(kernel_size={kernel_size!r}, stride={stride!r}): kernel sizes are "
                                     "odd (centre crops) and the stride a whole number >= 1.")
        self.stride, self.depthwise = stride, depthwise
        big = max(self.kernel_sizes)
        self.weight = nn.Parameter(torch.empty(max(self.out_sizes), 1 if depthwise else max(self.in_sizes), big, big))
        self.bias = nn.Parameter(torch.empty(max(self.out_sizes))) if bias else None
        steps = sorted(set(self.kernel_sizes), reverse=True)
        transforms = {f"{a}to{b}": nn.Parameter(torch.eye(b * b)) for a, b in zip(steps, steps[1:])}
        self.transforms = nn.ParameterDict(transforms) if kernel_transform and "kernel" in self.dims else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Conv2d``'s initialisation of the largest kernel; transforms back to the identity."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            nn.init.uniform_(self.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if self.transforms is not None:
            with torch.no_grad():
                for matrix in self.transforms.values():
                    matrix.copy_(torch.eye(matrix.shape[0]))

    def _slices(self, inputs: int, outputs: int, kernel: int) -> tuple[Tensor, Tensor | None]:
        weight = self.weight[:outputs] if self.depthwise else self.weight[:outputs, :inputs]
        size = weight.shape[-1]
        if self.transforms is None:
            start = (size - kernel) // 2
            weight = weight[:, :, start:start + kernel, start:start + kernel]
        else:
            for step in sorted((k for k in set(self.kernel_sizes) if kernel <= k < size), reverse=True):
                start = (size - step) // 2
                crop = weight[:, :, start:start + step, start:start + step].contiguous()
                weight = F.linear(crop.reshape(-1, step * step), self.transforms[f"{size}to{step}"])
                weight, size = weight.reshape(crop.shape), step
        return weight.contiguous(), None if self.bias is None else self.bias[:outputs].contiguous()

    def _sizes(self, architecture: Mapping[str, int] | None) -> tuple[int, int, int]:
        def size(name: str, fixed: tuple[int, ...]) -> int:
            return self.value(name, fixed) if architecture is None else self.value_in(name, architecture, fixed)
        inputs = size("in", self.in_sizes)
        return inputs, inputs if self.depthwise else size("width", self.out_sizes), size("kernel", self.kernel_sizes)

    def forward(self, x: Tensor) -> Tensor:
        inputs, outputs, kernel = self._sizes(None)
        _check_width(self, x.shape[1], inputs, "input channels")
        try:
            weight, bias = self._slices(inputs, outputs, kernel)
            return F.conv2d(x, weight, bias, (self.stride, self.stride), (kernel // 2, kernel // 2), (1, 1),
                            inputs if self.depthwise else 1)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """``nn.Conv2d`` with the (cropped or transformed) kernel ``architecture`` uses."""
        inputs, outputs, kernel = self._sizes(architecture)
        weight, bias = self._slices(inputs, outputs, kernel)  # as forward computes them, so bitwise the same
        return plain_copy(nn.Conv2d, self, {"weight": weight, "bias": bias},
                          inputs, outputs, kernel, self.stride, kernel // 2, groups=inputs if self.depthwise else 1,
                          bias=bias is not None, device=weight.device, dtype=weight.dtype)


class _ElasticBatchNorm(Elastic):
    """BatchNorm over the leading channels; see :class:`ElasticBatchNorm2d`."""

    plain: type[nn.Module] = nn.BatchNorm2d
    dims_allowed: tuple[int, ...] = (4,)

    def __init__(self, num_features: Sizes, label: str | None = None, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__()
        self.sizes = self.add_dim("width", num_features, label)
        self.eps, self.momentum, self.affine, self.track_running_stats = eps, momentum, affine, track_running_stats
        channels = max(self.sizes)
        self.weight = nn.Parameter(torch.ones(channels)) if affine else None
        self.bias = nn.Parameter(torch.zeros(channels)) if affine else None
        self.running_mean: Tensor | None
        self.running_var: Tensor | None
        self.num_batches_tracked: Tensor | None
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(channels))
            self.register_buffer("running_var", torch.ones(channels))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def reset_running_stats(self) -> None:
        """Running statistics back to their initial values (every channel)."""
        if self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """``nn.BatchNorm``'s initialisation: statistics reset, weight 1, bias 0."""
        self.reset_running_stats()
        if self.weight is not None and self.bias is not None:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _slices(self, channels: int) -> dict[str, Tensor | None]:
        """Views of the leading ``channels``: a training forward updates the running statistics in place."""
        def lead(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:channels]
        return {"weight": lead(self.weight), "bias": lead(self.bias), "running_mean": lead(self.running_mean),
                "running_var": lead(self.running_var)}

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() not in self.dims_allowed:
            raise ValueError(f"{self.where()} expects {' or '.join(map(str, self.dims_allowed))}-d input, "
                             f"got {x.dim()}-d")
        channels = self.value("width", self.sizes)
        _check_width(self, x.shape[1], channels, "channels")
        # as _BatchNorm.forward, on the leading channels (whose running statistics the views update in place)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        parts = self._slices(channels)
        track = not self.training or self.track_running_stats
        try:
            return F.batch_norm(x, parts["running_mean"] if track else None, parts["running_var"] if track else None,
                                parts["weight"], parts["bias"], use_batch, factor, self.eps)
        except RuntimeError as error:
            self.raise_located(error)

    def freeze_choice(self, architecture: Mapping[str, int]) -> nn.Module:
        """The plain BatchNorm of the chosen width with the leading channels' parameters and statistics."""
        channels = self.value_in("width", architecture, self.sizes)
        tensors = {**self._slices(channels), "num_batches_tracked": self.num_batches_tracked}
        reference = self.weight if self.weight is not None else self.running_mean
        kwargs: dict[str, Any] = {} if reference is None else {"device": reference.device, "dtype": reference.dtype}
        return plain_copy(self.plain, self, tensors, channels, self.eps, self.momentum, self.affine,
                          self.track_running_stats, **kwargs)


class ElasticBatchNorm2d(_ElasticBatchNorm):
    """``nn.BatchNorm2d`` over elastic channels: width ``w`` normalises with, and updates, the leading ``w``
    channels' parameters and running statistics (in place; the others are left exactly as they were).

    Give it the width label of the layer before it, so that both follow one choice.

    Args:
        num_features: a fixed channel count, or candidate counts.
        label: the width's label (the producing layer's).
        eps: as for ``nn.BatchNorm2d``.
        momentum: as for ``nn.BatchNorm2d`` (``None``: cumulative average over every forward, whatever its
            width, as the one ``num_batches_tracked`` counts them).
        affine: as for ``nn.BatchNorm2d``.
        track_running_stats: as for ``nn.BatchNorm2d``.
    """


class ElasticBatchNorm1d(_ElasticBatchNorm):
    """``nn.BatchNorm1d`` over elastic features (2-d or 3-d input); otherwise as :class:`ElasticBatchNorm2d`.

    Args:
        num_features: a fixed feature count, or candidate counts.
        label: the width's label (the producing layer's).
        eps: as for ``nn.BatchNorm1d``.
        momentum: as for ``nn.BatchNorm1d``.
        affine: as for ``nn.BatchNorm1d``.
        track_running_stats: as for ``nn.BatchNorm1d``.
    """

    plain = nn.BatchNorm1d
    dims_allowed = (2, 3)
