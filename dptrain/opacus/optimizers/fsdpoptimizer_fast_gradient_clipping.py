"""Opacus's ``opacus.optimizers.fsdpoptimizer_fast_gradient_clipping`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import FSDPOptimizerFastGradientClipping

__all__ = ["FSDPOptimizerFastGradientClipping"]
