"""Ghost rules for ``nn.Conv1d/2d/3d``: unfold to the outer-product form, per group.

A convolution with ``g`` groups is, per group, a Linear applied at every output position to the
unfolded input patch: ``A`` is ``[B, T, (C_in / g) * prod(k)]`` (T = number of output positions),
``G`` is ``[B, T, C_out / g]``. The per-sample weight gradient of group ``j`` is ``G_j^T A_j``, so
the ghost identity applies per group and the squared norms add up over groups.

The Gram of the unfolded input need not unfold either: with ``P = X X^T`` the Gram of the padded
input's pixels (``[N_pixels, N_pixels]`` over the ``C_in / g`` channels),
``(A A^T)[o, o'] = sum_k P[s o + d k, s o' + d k]`` (stride s, dilation d, kernel offsets k), summed
one spatial dimension at a time (:func:`pixel_patch_gram`). For 3x3 kernels on small feature maps
that is 3-9x fewer operations than the unfolded Gram and no ``K``-fold copy of the input; each entry
is a sum of ``K`` computed dot products of length ``C_in / g``, so its error is at most
``gamma_{C_in/g + K} ||a_o|| ||a_o'||`` (Cauchy-Schwarz over the kernel offsets), tighter than the
unfolded Gram's ``gamma_{C_in K / g}``. :func:`conv_patch_gram` takes the cheaper of the two
(:func:`prefers_pixel_gram`).

The clipped sum never unfolds: it is the convolution's own weight-gradient kernel
(``aten.convolution_backward``) applied to the reweighted output gradient, exactly the kernel
autograd would run for the non-private gradient.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from dptrain.grad_sample.conv import (
    conv_grad_sample,
    kernel_padding,
    pad_like_layer,
    unfold_patches,
    weight_grad_kernel,
)
from dptrain.grad_sample.ghost_math import (
    GramPair,
    GramSource,
    bias_sq_norms,
    gram,
    gram_bias_sq_norm_bounds,
    gram_dtype,
    instantiated_sq_norms,
    ghost_cost_ratio,
    norm_dtype,
    rounded_up,
    roundoff,
    tightened_gram_bounds,
    weighted_bias_sum,
)
from dptrain.grad_sample.ghost_registry import (
    Weights,
    register_clipped_sum,
    register_ghost_cost,
    register_instantiator,
)
from dptrain.grad_sample.registry import register_norm_sampler
from dptrain.grad_sample.workspace import sample_chunks

ConvNd = nn.Conv1d | nn.Conv2d | nn.Conv3d


def grouped_patches(layer: ConvNd, x: Tensor) -> Tensor:
    """Input patches per group: ``[B, C_in, *S]`` -> ``[B, groups, T, (C_in/groups) * K]``.

    The patch features are ordered like the flattened weight ``[C_out, C_in/groups, *k]``;
    padding, stride and dilation follow the layer (the grad sampler's unfolding).
    """
    patches = unfold_patches(layer, x)  # [B, C_in, T, K]
    batch, _, positions, kernel = patches.shape
    grouped = patches.reshape(batch, layer.groups, -1, positions, kernel)
    return grouped.permute(0, 1, 3, 2, 4).reshape(batch, layer.groups, positions, -1)


def grouped_backprops(layer: ConvNd, backprops: Tensor) -> Tensor:
    """Output gradients per group: ``[B, C_out, *L]`` -> ``[B, groups, T, C_out/groups]``."""
    batch, channels, positions = backprops.shape[0], backprops.shape[1], backprops.shape[2:].numel()
    g = backprops.reshape(batch, layer.groups, channels // layer.groups, positions)
    return g.transpose(2, 3)


def _flat(t: Tensor) -> Tensor:
    """``[B, groups, T, f]`` -> ``[B * groups, T, f]`` (groups become extra 'samples')."""
    return t.reshape(-1, t.shape[2], t.shape[3])


def _per_group_to_sample(values: Tensor, groups: int) -> Tensor:
    """``[B * groups]`` norms -> ``[B]`` by summing over groups."""
    return values.reshape(-1, groups).sum(dim=1)


def pixel_patch_gram(layer: ConvNd, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``A A^T`` of the unfolded input per (sample, group) without unfolding, ``[B * groups, T, T]``.

    Args:
        x: ``[B, C_in, *S]`` (unpadded); the Gram is computed in ``dtype``.
    """
    x = pad_like_layer(layer, x).to(dtype)
    batch, spatial = x.shape[0], x.shape[2:]
    pixels = x.reshape(batch * layer.groups, x.shape[1] // layer.groups, spatial.numel()).transpose(1, 2)  # [N, P, c]
    full = gram(pixels).view(-1, *spatial, *spatial)  # [N, *S, *S']
    dims = len(spatial)
    outputs = conv_output_shape(layer, spatial)
    for i, (k, stride, dilation, size) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation, outputs)):
        span = stride * (size - 1) + 1
        total = None
        for offset in range(k):
            window = [slice(None)] * full.dim()
            window[1 + i] = window[1 + dims + i] = slice(dilation * offset, dilation * offset + span, stride)
            part = full[tuple(window)]
            total = part if total is None else total + part
        full = total
    positions = math.prod(outputs)
    return full.reshape(-1, positions, positions)


def conv_output_shape(layer: ConvNd, padded: torch.Size) -> list[int]:
    """Output spatial sizes of ``layer`` on an already padded input of spatial shape ``padded``."""
    return [
        (size - dilation * (k - 1) - 1) // stride + 1
        for size, k, stride, dilation in zip(padded, layer.kernel_size, layer.stride, layer.dilation)
    ]


def prefers_pixel_gram(layer: ConvNd, x: Tensor, positions: int) -> bool:
    """Whether :func:`pixel_patch_gram` is the cheaper way to ``A A^T`` for input ``x``.

    Its product has ``pixels^2 * C_in/g`` multiply-adds against ``T^2 * C_in/g * K`` for the unfolded
    Gram, which also copies the input ``K`` times and multiplies ``K``-times longer, thinner
    matrices: measured on CPU, the pixel Gram is 1.6-16x faster on the paper CNNs' convolutions
    (also on mnist_cnn's strided 4x4 one, with 3x more multiply-adds). Taken while it has at most
    4x the multiply-adds (not, e.g., for a ViT patch embedding, where ``pixels^2`` is 10^4 times
    ``T^2 K``).
    """
    pixels = padded_pixels(layer, x)
    return pixels * pixels <= 4 * positions * positions * math.prod(layer.kernel_size)


def padded_pixels(layer: ConvNd, x: Tensor) -> int:
    """Number of pixels (positions) of one sample of ``x`` once padded as the layer pads it."""
    pixels = 1
    for i, size in enumerate(reversed(x.shape[2:])):  # padding is stored last dimension first
        pixels *= size + sum(layer._reversed_padding_repeated_twice[2 * i : 2 * i + 2])
    return pixels


def conv_patch_gram(layer: ConvNd, x: Tensor, positions: int, dtype: torch.dtype) -> tuple[Tensor, float]:
    """``(A A^T [B * groups, T, T], gamma)``: :func:`pixel_patch_gram` or the unfolded Gram
    (:func:`prefers_pixel_gram`), with its entries' error bound relative to ``||a_o|| ||a_o'||``."""
    channels, kernel = layer.in_channels // layer.groups, math.prod(layer.kernel_size)
    if prefers_pixel_gram(layer, x, positions):
        return pixel_patch_gram(layer, x, dtype), roundoff(channels + kernel, dtype)
    return gram(_flat(grouped_patches(layer, x.to(dtype)))), roundoff(channels * kernel, dtype)


def conv_gram_source(layer: ConvNd, x: Tensor, g: Tensor, gram_g: Optional[Tensor] = None) -> GramSource:
    """The Grams of a convolution's weight gradient per (sample, group), for
    :func:`~dptrain.grad_sample.ghost_math.tightened_gram_bounds`. ``g``: ``[B * groups, T, p]``."""
    positions = g.shape[1]

    def grams(dtype: torch.dtype, rows: Optional[Tensor]) -> GramPair:
        if rows is None:
            gram_a, gamma_a = conv_patch_gram(layer, x, positions, dtype)
            reuse = gram_g is not None and gram_g.dtype == dtype
            return gram_a, gram_g if reuse else gram(g.to(dtype)), gamma_a, roundoff(g.shape[2], dtype)
        samples, groups = rows // layer.groups, rows % layer.groups
        gram_a, gamma_a = conv_patch_gram(layer, x[samples], positions, dtype)
        gram_a = gram_a.view(samples.shape[0], layer.groups, positions, positions)[torch.arange(samples.shape[0]), groups]
        return gram_a, gram(g[rows].to(dtype)), gamma_a, roundoff(g.shape[2], dtype)

    return grams


def conv_weight_sq_norms(layer: ConvNd, x: Tensor, backprops: Tensor, ghost: bool) -> Tensor:
    """Per-sample squared norms of the conv weight gradient, ``[B]``, ghost (an upper bound, see
    :func:`~dptrain.grad_sample.ghost_math.gram_bounds`) or instantiated."""
    if not ghost:
        a, g = _flat(grouped_patches(layer, x)), _flat(grouped_backprops(layer, backprops))
        return _per_group_to_sample(instantiated_sq_norms(a, g), layer.groups)
    return rounded_up(_ghost_weight_bounds(layer, x, backprops), norm_dtype(backprops))


def _ghost_weight_bounds(layer: ConvNd, x: Tensor, backprops: Tensor, gram_g: Optional[Tensor] = None) -> Tensor:
    """``[B]`` float64 upper bounds of the weight gradients' squared norms (groups summed)."""
    g = _flat(grouped_backprops(layer, backprops))
    source = conv_gram_source(layer, x, g, gram_g)
    bounds = tightened_gram_bounds(source, gram_dtype(backprops), g.shape[0])
    return _per_group_to_sample(bounds, layer.groups)


def _bias_norms(backprops: Tensor) -> Tensor:
    """Per-sample squared norms of the conv bias gradient (upper bounds): ``[B, C_out, *L]`` -> ``[B]``."""
    g = backprops.reshape(backprops.shape[0], backprops.shape[1], -1).transpose(1, 2)
    return bias_sq_norms(g)


def _gram_workspace(layer: ConvNd, x: Tensor, backprops: Tensor) -> int:
    """Working memory of one sample's ghost norms, in elements: its patch Gram's input (the
    pixel Gram, or the unfolded patches), and the ``T x T`` Grams with their float64 copies."""
    positions = math.prod(backprops.shape[2:])
    if prefers_pixel_gram(layer, x, positions):
        patches = 2 * padded_pixels(layer, x) ** 2 * layer.groups
    else:
        patches = positions * x.shape[1] * math.prod(layer.kernel_size)
    return patches + 8 * positions * positions * layer.groups


def _chunk_norms(layer: ConvNd, x: Tensor, backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Squared-norm bounds ``{param: [b]}`` (norm dtype) of one chunk of samples."""
    out = norm_dtype(backprops)
    weight = layer.weight.requires_grad
    bias = layer.bias is not None and layer.bias.requires_grad
    norms = {}
    if weight and bias and layer.groups == 1:
        g = _flat(grouped_backprops(layer, backprops))  # [b, T, C_out]
        dtype = gram_dtype(backprops)
        gram_g = gram(g.to(dtype))
        norms[layer.weight] = rounded_up(_ghost_weight_bounds(layer, x, backprops, gram_g), out)
        norms[layer.bias] = rounded_up(gram_bias_sq_norm_bounds(gram_g, roundoff(g.shape[2], dtype), g), out)
        return norms
    if weight:
        norms[layer.weight] = conv_weight_sq_norms(layer, x, backprops, ghost=True)
    if bias:
        norms[layer.bias] = _bias_norms(backprops)
    return norms


@register_norm_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_norms(layer: ConvNd, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """``{weight: [B], bias: [B]}`` squared norms (upper bounds) by the Gram identity per group (with
    both trainable, one Gram of G serves both), over chunks of samples whose working memory fits in
    that of the layer's input and output gradient (:mod:`~dptrain.grad_sample.workspace`)."""
    x = activations[0]
    chunks = sample_chunks(x.shape[0], _gram_workspace(layer, x, backprops), x.numel() + backprops.numel())
    parts = [_chunk_norms(layer, x[rows], backprops[rows]) for rows in chunks]
    if len(parts) == 1:
        return parts[0]
    return {param: torch.cat([part[param] for part in parts]) for param in parts[0]}


register_instantiator(nn.Conv1d, nn.Conv2d, nn.Conv3d)(conv_grad_sample)  # float32 under bf16


def conv_weighted_weight_sum(layer: ConvNd, x: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i grad_i(weight)``, shape of the weight, by the conv weight-gradient kernel.

    Each sample's weight multiplies the smaller of its input and its output gradient (the gradient
    is linear in both); symmetric zero padding is left to the kernel (no padded copy). Over chunks
    of samples where padding copies make the working memory larger than ``x`` and ``backprops``
    (:mod:`~dptrain.grad_sample.workspace`), the chunks' sums added up.
    """
    dtype = norm_dtype(backprops)
    total = None
    per_sample = padded_pixels(layer, x) * x.shape[1] + backprops[0].numel()
    chunks = sample_chunks(x.shape[0], 2 * per_sample, 2 * (x.numel() + backprops.numel()))
    for rows in chunks:
        xs, padding = kernel_padding(layer, x[rows].to(dtype))
        gs = backprops[rows].to(dtype)
        w = weights[rows].to(dtype).view(-1, *([1] * (gs.dim() - 1)))
        if xs[0].numel() <= gs[0].numel():
            xs = xs * w
        else:
            gs = gs * w
        part = weight_grad_kernel(layer, xs, gs, layer.weight.detach().to(dtype), layer.groups, padding)
        total = part if total is None else total + part
    return total if total is not None else layer.weight.new_zeros(layer.weight.shape, dtype=dtype)


@register_clipped_sum(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_clipped_sum(
    layer: ConvNd, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``sum_i w_i grad_i`` for weight and bias, without unfolding the input."""
    sums = {}
    if layer.weight in weights:
        sums[layer.weight] = conv_weighted_weight_sum(layer, activations[0], backprops, weights[layer.weight])
    if layer.bias is not None and layer.bias in weights:
        g = backprops.reshape(backprops.shape[0], backprops.shape[1], -1).transpose(1, 2)
        sums[layer.bias] = weighted_bias_sum(g, weights[layer.bias])
    return sums


def conv_ghost_flops(layer: ConvNd, x: Tensor, backprops: Tensor) -> tuple[float, float]:
    """Per-sample multiply-adds of ``(ghost norm, instantiation)``: the patch Gram (pixel or
    unfolded, :func:`prefers_pixel_gram`) and ``G G^T`` against ``T p d``, over all groups."""
    positions = math.prod(backprops.shape[2:])
    channels, kernel = layer.in_channels // layer.groups, math.prod(layer.kernel_size)
    out_channels = layer.out_channels // layer.groups
    if prefers_pixel_gram(layer, x, positions):
        patch_gram = padded_pixels(layer, x) ** 2 * channels
    else:
        patch_gram = positions * positions * channels * kernel
    ghost = layer.groups * (patch_gram + positions * positions * out_channels)
    return float(ghost), float(layer.groups * positions * out_channels * channels * kernel)


@register_ghost_cost(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_prefers_ghost(layer: ConvNd, activations: list[Tensor], backprops: Tensor) -> bool:
    """Ghost when its norm's multiply-adds (:func:`conv_ghost_flops`, times the device's
    :func:`~dptrain.grad_sample.ghost_math.ghost_cost_ratio`) are at most instantiation's.

    Measured on CPU (one thread, B = 256; ``scripts/benchmark_conv_kernels.py``): this takes the
    ghost path for the paper CIFAR-10 CNN's 8x8 and 4x4 convolutions (2-3x faster than
    instantiating, and 6-50x less memory kept) and instantiates its 32x32 and 16x16 ones and
    mnist_cnn's two (1.5-70x faster).
    """
    ghost, instantiate = conv_ghost_flops(layer, activations[0], backprops)
    return ghost_cost_ratio(backprops) * ghost <= instantiate
