"""Opacus's ``opacus.grad_sample.dp_multihead_attention``: the rule of SequenceBias."""

from dptrain.grad_sample.sequence_bias import sequence_bias_grad_sample as compute_sequence_bias_grad_sample

__all__ = ["compute_sequence_bias_grad_sample"]
