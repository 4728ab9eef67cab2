"""Opacus's ``opacus.layers.dp_multihead_attention``."""

from dptrain.layers import DPMultiheadAttention, SequenceBias

__all__ = ["DPMultiheadAttention", "SequenceBias"]
