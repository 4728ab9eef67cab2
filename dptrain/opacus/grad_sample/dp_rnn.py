"""Opacus's ``opacus.grad_sample.dp_rnn``: the rule of RNNLinear (an nn.Linear applied at every
time step), which is dptrain's nn.Linear rule."""

from dptrain.grad_sample.linear import linear_grad_sample as compute_rnn_linear_grad_sample

__all__ = ["compute_rnn_linear_grad_sample"]
