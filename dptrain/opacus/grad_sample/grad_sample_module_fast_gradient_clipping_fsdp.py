"""Opacus's ``opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp``: dptrain's
ghost-clipping module recognises a model sharded with FSDP2 (utils.fsdp_utils.FSDP2Wrapper) by
itself, so the FSDP class is the same module."""

from dptrain.opacus._absent import absent
from dptrain.opacus.grad_sample import GradSampleModuleFastGradientClipping
from dptrain.opacus.grad_sample._hooks import HOOKS

GradSampleModuleFastGradientClippingFSDP = GradSampleModuleFastGradientClipping
GradSampleHooksFastGradientClippingFSDP = absent(
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp."
    "GradSampleHooksFastGradientClippingFSDP", HOOKS)

__all__ = ["GradSampleHooksFastGradientClippingFSDP", "GradSampleModuleFastGradientClippingFSDP"]
