"""Opacus's ``opacus.grad_sample.grad_sample_module_fast_gradient_clipping_tp``: ghost clipping
of a tensor-parallel model, which dptrain does not train (it shards with FSDP2 or replicates
with DDP)."""

from dptrain.opacus._absent import absent

_HERE = "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_tp"
_INSTEAD = ("FSDP2 sharding (dptrain.opacus.utils.fsdp_utils.FSDP2Wrapper, then make_private with "
            "grad_sample_mode='ghost_fsdp') or DDP; dptrain has no tensor-parallel DP-SGD")
GradSampleModuleFastGradientClippingTP = absent(f"{_HERE}.GradSampleModuleFastGradientClippingTP",
                                                _INSTEAD)
GradSampleHooksFastGradientClippingTP = absent(f"{_HERE}.GradSampleHooksFastGradientClippingTP",
                                               _INSTEAD)

__all__ = ["GradSampleHooksFastGradientClippingTP", "GradSampleModuleFastGradientClippingTP"]
