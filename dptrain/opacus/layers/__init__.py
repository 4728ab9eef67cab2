"""Opacus's ``opacus.layers``: dptrain's DP layers (same constructor arguments and state_dict
keys as the torch layers they replace)."""

from dptrain.layers import (DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPMultiheadAttention,
                            DPRNNCell, SequenceBias)
from dptrain.opacus.layers.param_rename import RenameParamsMixin

__all__ = ["DPGRU", "DPGRUCell", "DPLSTM", "DPLSTMCell", "DPMultiheadAttention", "DPRNN",
           "DPRNNCell", "RenameParamsMixin", "SequenceBias"]
