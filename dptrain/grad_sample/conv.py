"""Grad sampler for ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d``.

The input is padded exactly as the layer pads it (``padding_mode`` and "same"/"valid" included).
Sample b's weight gradient is then computed by one of three kernels, equal up to rounding, chosen
per call from the shapes (:func:`weight_grad_kernel_for`):

- grouped: the batch folded into the channels, one grouped convolution's weight-gradient kernel
  whose groups are the samples (no unfolding; fastest on large feature maps, on CPU);
- unfold: the patches each output position sees, ``X = [B, groups, C_in/groups, O, K]`` (O output
  positions, K kernel positions), and ``sum_o G_b[g, c_out, o] X_b[g, c_in, o, k]`` as one einsum;
- direct (one input channel per group only): the weight gradient ``dW_b[c_out, k] =
  sum_o G_b[c_out, o] X_b[stride * o + dilation * k]`` is itself a convolution of the input with
  the output gradient as its kernel (dilated by the layer's stride, strided by its dilation): one
  forward grouped convolution, one group per sample and input channel (on CPU up to 4.5x faster
  than the grouped weight-gradient kernel for single-channel inputs, such as mnist_cnn's first
  layer).

The bias gradient is ``sum_o G_b``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dptrain.grad_sample.ghost_math import norm_dtype
from dptrain.grad_sample.registry import register_grad_sampler
from dptrain.grad_sample.workspace import sample_chunks


def pad_like_layer(layer: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """``x`` padded as ``layer.forward`` pads it (so the convolution itself uses no padding)."""
    pads = layer._reversed_padding_repeated_twice
    if not any(pads):
        return x
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(x, pads, mode=mode)


def kernel_padding(layer: nn.modules.conv._ConvNd, x: Tensor) -> tuple[Tensor, list[int]]:
    """``(input, padding)`` for a convolution kernel to see ``x`` as the layer does: the layer's
    own zero padding passed to the kernel when symmetric (no padded copy), else ``x`` padded here."""
    pads = layer._reversed_padding_repeated_twice  # last dimension first, (left, right) pairs
    symmetric = all(pads[i] == pads[i + 1] for i in range(0, len(pads), 2))
    if layer.padding_mode == "zeros" and symmetric:
        return x, list(reversed(pads[::2]))
    return pad_like_layer(layer, x), [0] * len(layer.kernel_size)


def unfold_patches(layer: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The patches of ``x`` each output position sees.

    Args:
        x: ``[B, C_in, *spatial]``.

    Returns:
        ``[B, C_in, O, K]`` with O the number of output positions and K the kernel size (both
        products over the spatial dimensions).
    """
    x = pad_like_layer(layer, x)
    for d, (k, s, dil) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        x = x.unfold(2 + d, dil * (k - 1) + 1, s)  # window of the dilated kernel
        if dil > 1:
            x = x[..., ::dil]
    # x: [B, C, O_1..O_n, K_1..K_n]
    batch, channels = x.shape[:2]
    return x.reshape(batch, channels, -1, math.prod(layer.kernel_size))


#: Kernels for the per-sample weight gradients (see :func:`conv_weight_grad_samples`).
KERNELS = ("auto", "grouped", "unfold", "direct")


def weight_grad_kernel(
    layer: nn.modules.conv._ConvNd, x: Tensor, backprops: Tensor, weight: Tensor, groups: int,
    padding: Optional[list[int]] = None,
) -> Tensor:
    """The convolution's own weight-gradient kernel (``aten.convolution_backward``) on ``x``.

    Args:
        x: the input already padded as the layer pads it (:func:`pad_like_layer`), or unpadded
            with the ``padding`` to apply (:func:`kernel_padding`).
        backprops: gradient w.r.t. the output, ``[N, groups * out/groups, *spatial_out]``.
        weight: a tensor of the weight's shape for these ``groups`` (only its shape is used).
    Returns the weight gradient (no input or bias gradient is computed).
    """
    dims = len(layer.kernel_size)
    _, grad_weight, _ = torch.ops.aten.convolution_backward(
        backprops, x, weight, None, layer.stride, padding or [0] * dims, layer.dilation, False, [0] * dims,
        groups, [False, True, False],
    )
    return grad_weight


def prefers_grouped_kernel(layer: nn.modules.conv._ConvNd, backprops: Tensor) -> bool:
    """Whether the grouped-convolution kernel is the faster one for these shapes and device.

    CPU, measured (1 and 2 threads, B = 64 and 256; ``scripts/benchmark_conv_kernels.py``): the
    grouped kernel is 1.5-9x faster where the output has more than 64 positions (it never unfolds
    the input) or fewer than 128 output channels per group (mnist_cnn's 4x4 stride-2 convolution on
    25 positions: 1.5-1.7x; depthwise 3x3 convolutions: 5-15x), and 1.0-1.7x slower on small
    feature maps with many output channels (cifar10_cnn's 8x8 and 4x4 maps, 128-256 channels), where
    unfolding is cheap next to the product.

    Elsewhere (CUDA; not measured here): unfold + einsum, one batched matrix product (Opacus's
    kernel too), whose memory the chunking bounds; a convolution with ``B * groups`` groups is left
    to cuDNN's choice of algorithm, which is not known to be fast for thousands of groups.
    """
    if backprops.device.type != "cpu":
        return False
    positions = math.prod(backprops.shape[2:])
    return positions > 64 or layer.out_channels // layer.groups < 128


def prefers_direct_kernel(layer: nn.modules.conv._ConvNd, backprops: Tensor) -> bool:
    """Whether the direct kernel is the faster one: on CPU, for a single-channel input.

    Measured on CPU (1 thread, B = 64 and 256; ``scripts/benchmark_conv_kernels.py`` for
    mnist_cnn's layer): for mnist_cnn's 8x8 stride-2 first layer 1.6x (B = 64) and 3-4x (B = 256)
    faster than the grouped kernel and 1.1-3x faster than unfold; for 3x3 to 8x8 single-channel
    2-d convolutions on 28x28 inputs, stride 1 or 2, 1.1-3.4x faster than grouped and within 3% of
    unfold or faster, except 5x5 stride 1 with 32 output channels at B = 64 (grouped 2.3x faster);
    a tie for a small dilated Conv1d. Mixed for depthwise convolutions (one input channel per
    group, several groups), which keep the other rule.
    """
    return backprops.device.type == "cpu" and layer.in_channels == 1


def weight_grad_kernel_for(layer: nn.modules.conv._ConvNd, backprops: Tensor) -> str:
    """The kernel ``"auto"`` runs for these shapes and device: ``"direct"``, ``"grouped"`` or
    ``"unfold"`` (:func:`prefers_direct_kernel`, then :func:`prefers_grouped_kernel`)."""
    if prefers_direct_kernel(layer, backprops):
        return "direct"
    return "grouped" if prefers_grouped_kernel(layer, backprops) else "unfold"


def _direct_weight_grads(layer: nn.modules.conv._ConvNd, x: Tensor, backprops: Tensor) -> Tensor:
    """``[B, *weight.shape]`` as one forward convolution of the input (``[1, B * C_in, *S]``, one
    group per sample and input channel) with the output gradients as kernels (``[B * C_out, 1,
    *S_out]``, dilated by the layer's stride, strided by its dilation). Needs ``C_in == groups``.

    The result covers at least the kernel's extent; positions past it (input rows the layer's
    stride never reached) are cut off.
    """
    if layer.in_channels != layer.groups:
        raise ValueError(
            f"the direct per-sample kernel needs one input channel per group; {layer} has "
            f"{layer.in_channels // layer.groups}."
        )
    batch, dims = backprops.shape[0], len(layer.kernel_size)
    x, padding = kernel_padding(layer, x)
    kernels = backprops.reshape(batch * layer.out_channels, 1, *backprops.shape[2:])
    out = torch.ops.aten.convolution(
        x.reshape(1, -1, *x.shape[2:]), kernels, None, list(layer.dilation), padding, list(layer.stride),
        False, [0] * dims, batch * layer.groups,
    )
    extent = (Ellipsis, *(slice(0, k) for k in layer.kernel_size))
    return out.view(batch, layer.out_channels, 1, *out.shape[2:])[extent].contiguous()


def _grouped_weight_grads(layer: nn.modules.conv._ConvNd, x: Tensor, backprops: Tensor) -> Tensor:
    """``[B, *weight.shape]`` in one grouped convolution: the batch is folded into the channels
    (``[1, B * C_in, *S]``), so each sample is a group of its own."""
    batch = backprops.shape[0]
    x, padding = kernel_padding(layer, x)
    x = x.reshape(1, -1, *x.shape[2:])
    g = backprops.reshape(1, -1, *backprops.shape[2:])
    # the kernel reads only the weight's shape for the weight gradient: an uninitialised tensor of
    # that shape (a copy of the weight per sample would be written, and its pages faulted in)
    weight = g.new_empty(batch * layer.weight.shape[0], *layer.weight.shape[1:])
    grad = weight_grad_kernel(layer, x, g, weight, batch * layer.groups, padding)
    return grad.reshape(batch, *layer.weight.shape)


def _unfolded_weight_grads(layer: nn.modules.conv._ConvNd, x: Tensor, backprops: Tensor) -> Tensor:
    """``[B, *weight.shape]`` as one einsum over the unfolded input patches."""
    batch, groups = backprops.shape[0], layer.groups
    g = backprops.reshape(batch, groups, layer.out_channels // groups, -1)  # [B, G, Co/G, O]
    patches = unfold_patches(layer, x)
    patches = patches.reshape(batch, groups, layer.in_channels // groups, *patches.shape[2:])
    return torch.einsum("bgpo,bgcok->bgpck", g, patches).reshape(batch, *layer.weight.shape)


def conv_weight_grad_samples(
    layer: nn.modules.conv._ConvNd, x: Tensor, backprops: Tensor, kernel: str = "auto"
) -> Tensor:
    """Per-sample weight gradients ``[B, C_out, C_in/groups, *kernel_size]`` (dtype of the inputs).

    Args:
        x: the layer's input ``[B, C_in, *spatial_in]`` (unpadded).
        backprops: ``[B, C_out, *spatial_out]``, in the same dtype as ``x``.
        kernel: ``"grouped"``, ``"unfold"``, ``"direct"`` (equal up to rounding; direct only for
            one input channel per group) or ``"auto"`` (:func:`weight_grad_kernel_for`).

    Runs over chunks of samples whose unfolded inputs and gradients fit in the memory of ``x`` and
    ``backprops`` (:mod:`~dptrain.grad_sample.workspace`): the kernels' working memory is several
    times their output.
    """
    if kernel not in KERNELS:
        raise ValueError(f"conv_weight_grad_samples(kernel={kernel!r}): use one of {KERNELS}.")
    if kernel == "auto":
        kernel = weight_grad_kernel_for(layer, backprops)
    compute = {"grouped": _grouped_weight_grads, "unfold": _unfolded_weight_grads, "direct": _direct_weight_grads}[kernel]
    batch = backprops.shape[0]
    chunks = sample_chunks(batch, per_sample_workspace(layer, backprops), x.numel() + backprops.numel())
    if len(chunks) <= 1:
        return compute(layer, x, backprops)
    out = backprops.new_empty(batch, *layer.weight.shape)
    for rows in chunks:
        out[rows] = compute(layer, x[rows], backprops[rows])
    return out


def per_sample_workspace(layer: nn.modules.conv._ConvNd, backprops: Tensor) -> int:
    """Working memory of one sample's weight gradient, in elements: its unfolded input
    (``T * C_in * K``), its output gradient and the gradient itself."""
    positions = math.prod(backprops.shape[2:])
    return positions * layer.in_channels * math.prod(layer.kernel_size) + backprops[0].numel() + layer.weight.numel()


@register_grad_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_grad_sample(
    layer: nn.modules.conv._ConvNd, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of a convolution, in :func:`norm_dtype` of the backprops.

    Args:
        activations: ``[x]`` with x ``[B, C_in, *spatial_in]``.
        backprops: ``[B, C_out, *spatial_out]``.

    Returns:
        weight: ``[B, C_out, C_in/groups, *kernel_size]``; bias: ``[B, C_out]``.
    """
    dtype = norm_dtype(backprops)
    g = backprops.to(dtype)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = conv_weight_grad_samples(layer, activations[0].to(dtype), g)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = g.flatten(2).sum(dim=2)
    return grads
