"""Opacus's ``opacus.layers.dp_multihead_attention``."""

from dptrain.layers import DPMultiheadAttention

__all__ = ["DPMultiheadAttention"]
