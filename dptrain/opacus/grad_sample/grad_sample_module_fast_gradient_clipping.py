"""Opacus's ``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``: dptrain's
ghost-clipping module."""

from dptrain.opacus._absent import absent
from dptrain.opacus.grad_sample import GradSampleModuleFastGradientClipping
from dptrain.opacus.grad_sample._hooks import BOOKKEEPING, HOOKS

_HERE = "opacus.grad_sample.grad_sample_module_fast_gradient_clipping"
GradSampleHooksFastGradientClipping = absent(f"{_HERE}.GradSampleHooksFastGradientClipping", HOOKS)
create_norm_sample = absent(f"{_HERE}.create_norm_sample", BOOKKEEPING)

__all__ = ["GradSampleHooksFastGradientClipping", "GradSampleModuleFastGradientClipping",
           "create_norm_sample"]
