"""Opacus's ``opacus.layers.dp_rnn``."""

from dptrain.layers import DPGRU, DPLSTM, DPRNN

__all__ = ["DPGRU", "DPLSTM", "DPRNN"]
