"""Norm samplers for the normalisation layers: their per-sample gradients are already small.

LayerNorm, GroupNorm, InstanceNorm1d/2d/3d and RMSNorm own per-channel affine parameters, so a
per-sample gradient is ``[B, C]``: forming it (with the layer's grad sampler) is as cheap as any
ghost trick and keeps nothing larger than the norms themselves. Their cost rule therefore always
prefers instantiation (``strategy="auto"``); the norm samplers registered here serve users of the
norm-sampler API and ``strategy="ghost"`` (whose clipped sum is then one reweighted backward of
the layer, :mod:`~dptrain.grad_sample.ghost_vjp`).
"""

from __future__ import annotations

from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost_math import promoted, sq_norms
from dptrain.grad_sample.ghost_registry import register_ghost_cost
from dptrain.grad_sample.registry import get_grad_sampler, register_norm_sampler

NORMALIZATION_LAYERS: tuple[type, ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.RMSNorm,
)


def instantiated_norms(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """``{param: [B]}`` squared norms of the per-sample gradients from ``layer``'s grad sampler.

    The sampler runs on the inputs and output gradients in float32 when they are 16-bit: the
    clipped sum of a ghost normalisation layer comes from a float32 re-run of the layer
    (:mod:`~dptrain.grad_sample.ghost_vjp`), whose gradients these norms must bound, not from their
    16-bit roundings.
    """
    sampler = get_grad_sampler(layer)
    if sampler is None:
        raise UnsupportedModuleError(
            f"No grad sampler is registered for {type(layer).__name__}, so its per-sample "
            f"gradient norms cannot be formed; register one with @dptrain.register_grad_sampler."
        )
    grads = sampler(layer, [promoted(a) for a in activations], promoted(backprops))
    return {p: sq_norms(g) for p, g in grads.items()}


register_norm_sampler(*NORMALIZATION_LAYERS)(instantiated_norms)


@register_ghost_cost(*NORMALIZATION_LAYERS)
def normalization_prefers_ghost(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> bool:
    """Never: a ``[B, C]`` per-sample gradient is cheaper than keeping A and G for a ghost norm."""
    return False
