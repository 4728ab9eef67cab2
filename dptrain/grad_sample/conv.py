"""Grad sampler for ``nn.Conv1d`` / ``Conv2d`` / ``Conv3d``.

The input is padded exactly as the layer pads it (``padding_mode`` and "same"/"valid" included),
then unfolded into the patches each output position sees: ``X = [B, groups, C_in/groups, O, K]``
(O output positions, K kernel positions). Sample b's weight gradient is
``sum_o G_b[g, c_out, o] X_b[g, c_in, o, k]`` (one einsum), its bias gradient ``sum_o G_b``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dptrain.grad_sample.registry import register_grad_sampler


def _pad_like_layer(layer: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """``x`` padded as ``layer.forward`` pads it (so the convolution itself uses no padding)."""
    pads = layer._reversed_padding_repeated_twice
    if not any(pads):
        return x
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(x, pads, mode=mode)


def unfold_patches(layer: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The patches of ``x`` each output position sees.

    Args:
        x: ``[B, C_in, *spatial]``.

    Returns:
        ``[B, C_in, O, K]`` with O the number of output positions and K the kernel size (both
        products over the spatial dimensions).
    """
    x = _pad_like_layer(layer, x)
    for d, (k, s, dil) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        x = x.unfold(2 + d, dil * (k - 1) + 1, s)  # window of the dilated kernel
        if dil > 1:
            x = x[..., ::dil]
    # x: [B, C, O_1..O_n, K_1..K_n]
    batch, channels = x.shape[:2]
    return x.reshape(batch, channels, -1, math.prod(layer.kernel_size))


@register_grad_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_grad_sample(
    layer: nn.modules.conv._ConvNd, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of a convolution.

    Args:
        activations: ``[x]`` with x ``[B, C_in, *spatial_in]``.
        backprops: ``[B, C_out, *spatial_out]``.

    Returns:
        weight: ``[B, C_out, C_in/groups, *kernel_size]``; bias: ``[B, C_out]``.
    """
    batch, groups = backprops.shape[0], layer.groups
    g = backprops.reshape(batch, groups, layer.out_channels // groups, -1)  # [B, G, Co/G, O]
    grads = {}
    if layer.weight.requires_grad:
        patches = unfold_patches(layer, activations[0].to(g.dtype))
        patches = patches.reshape(batch, groups, layer.in_channels // groups, *patches.shape[2:])
        weight = torch.einsum("bgpo,bgcok->bgpck", g, patches)
        grads[layer.weight] = weight.reshape(batch, *layer.weight.shape)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = g.sum(dim=3).reshape(batch, -1)
    return grads
