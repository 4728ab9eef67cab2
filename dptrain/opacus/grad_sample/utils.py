"""Opacus's ``opacus.grad_sample.utils``: register_grad_sampler, wrap_model, get_gsm_class."""

from __future__ import annotations

from dptrain.grad_sample.registry import register_grad_sampler
from dptrain.opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping, wrap_model


def get_gsm_class(grad_sample_mode: str) -> type:
    """The module class of `grad_sample_mode` ("hooks", "functorch", "ew": GradSampleModule;
    "ghost", "ghost_fsdp": the ghost-clipping module, which also serves an FSDP2-sharded model)."""
    if grad_sample_mode in ("ghost", "ghost_fsdp"):
        return GradSampleModuleFastGradientClipping
    if grad_sample_mode in ("hooks", "functorch", "ew"):
        return GradSampleModule
    raise ValueError(f"Unexpected grad_sample_mode: {grad_sample_mode}")


__all__ = ["get_gsm_class", "register_grad_sampler", "wrap_model"]
