"""Opacus's ``opacus.optimizers.optimizer``."""

from dptrain.opacus.optimizers import DPOptimizer

__all__ = ["DPOptimizer"]
