"""Opacus's ``opacus.optimizers.ddp_perlayeroptimizer`` (see dptrain.opacus.optimizers)."""

from dptrain.opacus.optimizers import DistributedPerLayerOptimizer, SimpleDistributedPerLayerOptimizer

__all__ = ["DistributedPerLayerOptimizer", "SimpleDistributedPerLayerOptimizer"]
