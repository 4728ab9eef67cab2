"""Opacus's ``opacus.optimizers.adaclipoptimizer`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import AdaClipDPOptimizer

__all__ = ["AdaClipDPOptimizer"]
