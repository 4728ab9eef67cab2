"""Opacus's ``opacus.optimizers.ddpoptimizer`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import DistributedDPOptimizer

__all__ = ["DistributedDPOptimizer"]
