"""Opacus's ``opacus.optimizers.perlayeroptimizer`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import DPPerLayerOptimizer

__all__ = ["DPPerLayerOptimizer"]
