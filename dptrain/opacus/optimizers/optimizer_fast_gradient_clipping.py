"""Opacus's ``opacus.optimizers.optimizer_fast_gradient_clipping`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import DPOptimizerFastGradientClipping

__all__ = ["DPOptimizerFastGradientClipping"]
