"""Opacus's ``opacus.grad_sample.utils``: register_grad_sampler / register_norm_sampler,
wrap_model, prepare_module, get_gsm_class, get_hooks_class."""

from __future__ import annotations

from dptrain.grad_sample.registry import register_grad_sampler
from dptrain.grad_sample.registry import register_norm_sampler
from dptrain.opacus.grad_sample import (GradSampleHooks, GradSampleHooksFastGradientClipping,
                                        get_gsm_class, prepare_module, wrap_model)


def get_hooks_class(grad_sample_mode: str) -> type:
    """Opacus's hooks class of `grad_sample_mode`; dptrain's modules install their own hooks."""
    return GradSampleHooksFastGradientClipping if grad_sample_mode in ("ghost", "ghost_fsdp") \
        else GradSampleHooks


__all__ = ["get_gsm_class", "get_hooks_class", "prepare_module", "register_grad_sampler",
           "register_norm_sampler", "wrap_model"]
