"""Opacus's ``opacus.optimizers.ddpoptimizer_fast_gradient_clipping`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import DistributedDPOptimizerFastGradientClipping

__all__ = ["DistributedDPOptimizerFastGradientClipping"]
