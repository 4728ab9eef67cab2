"""Opacus's ``opacus.grad_sample.embedding_norm_sample``."""

from dptrain.opacus.grad_sample.embedding import compute_embedding_norm_sample

__all__ = ["compute_embedding_norm_sample"]
