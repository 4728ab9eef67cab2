"""Opacus's ``opacus.optimizers.optimizer``: DPOptimizer and the processed-flag helpers that
Opacus's tutorials use in DPOptimizer subclasses (``add_noise`` overrides)."""

from dptrain.opacus.optimizers import DPOptimizer
from dptrain.opacus.optimizers.processed_flag import _check_processed_flag, _mark_as_processed

__all__ = ["DPOptimizer", "_check_processed_flag", "_mark_as_processed"]
