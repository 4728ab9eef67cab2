"""Opacus's ``opacus.grad_sample.gsm_no_op``: a module computing no per-sample gradients
(Opacus's grad_sample_mode="no_op", for non-private baselines), which dptrain does not have."""

from dptrain.opacus._absent import absent

_INSTEAD = ("the plain model and a plain torch optimizer for a non-private baseline (without "
            "make_private), or GradSampleModule for DP-SGD")
GradSampleModuleNoOp = absent("opacus.grad_sample.gsm_no_op.GradSampleModuleNoOp", _INSTEAD)
GradSampleHooksNoOp = absent("opacus.grad_sample.gsm_no_op.GradSampleHooksNoOp", _INSTEAD)

__all__ = ["GradSampleHooksNoOp", "GradSampleModuleNoOp"]
