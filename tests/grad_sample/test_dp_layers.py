"""The DP layers (built from Linear pieces) get exact per-sample gradients through the engine."""

import pytest
import torch
from torch import nn

from dptrain.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64


class FirstOutput(nn.Module):
    """Keep only the first element of a layer's tuple output (the sequence of outputs)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.layer(*inputs)[0]


def sequence_first_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sum(out * target) with out [T, B, ...] and target indexed by sample [B, T, ...]."""
    return (out.transpose(0, 1) * target).sum()


sequence_first_loss.reduction = "sum"


def batch_first_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * target).sum()


batch_first_loss.reduction = "sum"

RNNS = {
    "lstm_2layer_bidirectional": lambda bf: DPLSTM(3, 4, num_layers=2, bidirectional=True, batch_first=bf),
    "lstm_proj": lambda bf: DPLSTM(3, 4, proj_size=2, batch_first=bf),
    "gru_bidirectional": lambda bf: DPGRU(3, 4, bidirectional=True, batch_first=bf),
    "rnn_relu_2layer": lambda bf: DPRNN(3, 4, num_layers=2, nonlinearity="relu", batch_first=bf),
}


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("name", RNNS)
def test_dp_recurrent_layer_per_sample_gradients_are_exact(name, batch_first) -> None:
    model = FirstOutput(RNNS[name](batch_first)).double()
    x = torch.randn((4, 5, 3) if batch_first else (5, 4, 3), dtype=F64)
    with torch.no_grad():
        out = model(x)
    target = torch.randn_like(out if batch_first else out.transpose(0, 1))
    loss = batch_first_loss if batch_first else sequence_first_loss
    assert_per_sample_exact(model, x, target, loss, batch_first=batch_first)


ATTENTION = {
    "plain": dict(),
    "kdim_vdim": dict(kdim=5, vdim=2),
    "bias_kv_zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
}


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("name", ATTENTION)
def test_dp_multihead_attention_per_sample_gradients_are_exact(name, batch_first) -> None:
    kwargs = ATTENTION[name]
    model = FirstOutput(DPMultiheadAttention(4, 2, batch_first=batch_first, **kwargs)).double()
    shape = (lambda d: (3, 5, d)) if batch_first else (lambda d: (5, 3, d))
    q = torch.randn(shape(4), dtype=F64)
    k, v = torch.randn(shape(kwargs.get("kdim", 4)), dtype=F64), torch.randn(shape(kwargs.get("vdim", 4)), dtype=F64)
    with torch.no_grad():
        out = model(q, k, v)
    target = torch.randn_like(out if batch_first else out.transpose(0, 1))
    loss = batch_first_loss if batch_first else sequence_first_loss
    assert_per_sample_exact(model, (q, k, v), target, loss, batch_first=batch_first)
