"""Opacus's ``opacus.grad_sample.gsm_exp_weights``: grad_sample_mode="ew" runs dptrain's hooks
(the same per-sample gradients), so its module is the GradSampleModule."""

from dptrain.opacus.grad_sample import GradSampleModule as GradSampleModuleExpandedWeights

__all__ = ["GradSampleModuleExpandedWeights"]
