"""Grad samplers for the per-sample normalisation layers: LayerNorm, GroupNorm, InstanceNorm, RMSNorm.

Each normalises within one sample, so with ``x_hat`` the normalised input (no affine) and ``G`` the
backprops, sample b's weight gradient is ``sum(G_b * x_hat_b)`` and its bias gradient ``sum(G_b)``,
summed over every dimension the parameter is broadcast along.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dptrain.grad_sample.registry import register_grad_sampler


def sum_to_param(t: Tensor, param: nn.Parameter, channel_dim: int | None) -> Tensor:
    """Reduce ``t`` ``[B, ...]`` to ``[B, *param.shape]`` by summing the broadcast dimensions.

    Args:
        t: per-sample contribution, batch first.
        param: the parameter; with ``channel_dim=None`` its shape is the trailing dims of ``t``
            (LayerNorm, RMSNorm), else ``[C]`` sitting at ``channel_dim`` of ``t`` (GroupNorm,
            InstanceNorm).
    """
    if channel_dim is None:
        lead = tuple(range(1, t.dim() - param.dim()))
    else:
        lead = tuple(d for d in range(1, t.dim()) if d != channel_dim)
    return t.sum(dim=lead) if lead else t.clone()


def affine_grads(
    layer: nn.Module, normalized: Tensor, backprops: Tensor, channel_dim: int | None
) -> dict[nn.Parameter, Tensor]:
    """Per-sample grads of ``weight`` (``G * x_hat``) and ``bias`` (``G``) that require grad."""
    grads = {}
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if weight is not None and weight.requires_grad:
        grads[weight] = sum_to_param(backprops * normalized.to(backprops.dtype), weight, channel_dim)
    if bias is not None and bias.requires_grad:
        grads[bias] = sum_to_param(backprops, bias, channel_dim)
    return grads


@register_grad_sampler(nn.LayerNorm)
def layer_norm_grad_sample(layer: nn.LayerNorm, activations: list[Tensor], backprops: Tensor) -> dict:
    """x ``[B, *, *normalized_shape]``; returns weight/bias ``[B, *normalized_shape]``."""
    x_hat = F.layer_norm(activations[0], layer.normalized_shape, eps=layer.eps)
    return affine_grads(layer, x_hat, backprops, channel_dim=None)


@register_grad_sampler(nn.RMSNorm)
def rms_norm_grad_sample(layer: nn.RMSNorm, activations: list[Tensor], backprops: Tensor) -> dict:
    """x ``[B, *, *normalized_shape]``; returns weight ``[B, *normalized_shape]``."""
    x_hat = F.rms_norm(activations[0], layer.normalized_shape, eps=layer.eps)
    return affine_grads(layer, x_hat, backprops, channel_dim=None)


@register_grad_sampler(nn.GroupNorm)
def group_norm_grad_sample(layer: nn.GroupNorm, activations: list[Tensor], backprops: Tensor) -> dict:
    """x ``[B, C, *]``; returns weight/bias ``[B, C]``."""
    x_hat = F.group_norm(activations[0], layer.num_groups, eps=layer.eps)
    return affine_grads(layer, x_hat, backprops, channel_dim=1)


@register_grad_sampler(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm_grad_sample(
    layer: nn.modules.instancenorm._InstanceNorm, activations: list[Tensor], backprops: Tensor
) -> dict:
    """x ``[B, C, *]`` (training mode: each sample's own statistics); returns weight/bias ``[B, C]``."""
    x_hat = F.instance_norm(activations[0], eps=layer.eps)
    return affine_grads(layer, x_hat, backprops, channel_dim=1)
