"""Opacus's ``opacus.layers.dp_rnn``: dptrain's recurrent DP layers, their cells and bases."""

from dptrain.layers import (DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPRNNBase, DPRNNCell,
                            DPRNNCellBase, RNNLinear)
from dptrain.opacus._absent import absent

apply_permutation = absent(
    "opacus.layers.dp_rnn.apply_permutation",
    "tensor.index_select(dim, permutation) (dptrain's DP layers order a PackedSequence "
    "themselves)")

__all__ = ["DPGRU", "DPGRUCell", "DPLSTM", "DPLSTMCell", "DPRNN", "DPRNNBase", "DPRNNCell",
           "DPRNNCellBase", "RNNLinear", "apply_permutation"]
