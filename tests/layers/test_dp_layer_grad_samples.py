"""Per-sample gradients of the DP layers through GradSampleModule equal micro-batch recomputation.

Each DP layer sits in a tiny parameter-free wrapper that turns its outputs (and final states) into
``[B, F]`` features; the ground truth runs the wrapper on every sample alone
(``dptrain.grad_sample.check.microbatch_grad_samples``). Inputs with a batch axis are passed with
the batch where the layer's ``batch_first`` puts it, as the check narrows every input there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dptrain.errors import ConfigError
from dptrain.grad_sample.check import microbatch_grad_samples, wrapped_grad_samples
from dptrain.grad_sample.module import GradSampleModule
from dptrain.grad_sample.registry import get_grad_sampler, get_norm_sampler
from dptrain.layers import (
    DPGRU,
    DPLSTM,
    DPRNN,
    DPGRUCell,
    DPLSTMCell,
    DPMultiheadAttention,
    DPRNNCell,
    SequenceBias,
)

DT = torch.float64
BATCH, STEPS, INPUT, HIDDEN = 4, 5, 3, 4
LENGTHS = torch.tensor([3, 5, 1, 4])  # unsorted
EMBED_FOR_BIAS = 4


class _RecurrentFeatures(nn.Module):
    """[B, F] features from every output step and the final hidden state of a DP recurrent layer.

    ``forward(x, lengths=None, h0=None, c0=None)``: ``x`` in the layer layout; ``lengths``
    (packed input) and the initial states carry the batch at the layer's batch axis: ``lengths``
    ``[B]`` or ``[1, B]``, ``h0``/``c0`` ``[B, L*D, H]`` or ``[L*D, B, H]``.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.time_dim = 1 if layer.batch_first else 0

    def forward(self, x, lengths=None, h0=None, c0=None):  # noqa: ANN001, ANN201
        if lengths is not None:
            x = pack_padded_sequence(
                x, lengths.reshape(-1).cpu(), self.layer.batch_first, enforce_sorted=False
            )
        states = [
            t if not self.layer.batch_first else t.transpose(0, 1)
            for t in (h0, c0)
            if t is not None
        ]
        hx = None if not states else states[0] if len(states) == 1 else tuple(states)
        output, state = self.layer(x, hx)
        if lengths is not None:
            output, _ = pad_packed_sequence(output, batch_first=self.layer.batch_first)
        hidden = state[0] if isinstance(state, tuple) else state  # [L*D, B, H]
        hidden = hidden.transpose(0, 1).reshape(hidden.shape[1], -1)
        return torch.cat([output.pow(2).sum(self.time_dim), hidden], dim=-1)


class _CellUnrolled(nn.Module):
    """A DP cell applied over the time axis of ``x`` ``[B, T, D]``: one module used T times."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x):  # noqa: ANN001, ANN201
        state = None
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return torch.cat(state, -1) if isinstance(state, tuple) else state


class _AttentionFeatures(nn.Module):
    """[B, E] features of self-attention, with a fixed ``attn_mask`` and per-sample padding."""

    def __init__(self, attention: DPMultiheadAttention, attn_mask=None) -> None:  # noqa: ANN001
        super().__init__()
        self.attention = attention
        self.attn_mask = attn_mask

    def forward(self, query, key, value, key_padding=None):  # noqa: ANN001, ANN201
        batch_first = self.attention.batch_first
        if key_padding is not None and not batch_first:
            key_padding = key_padding.t()  # given [S, B] so that the batch is on dim 1
        output, _ = self.attention(
            query, key, value, key_padding_mask=key_padding, attn_mask=self.attn_mask
        )
        return output.pow(2).sum(1 if batch_first else 0)


def _assert_engine_matches_microbatches(model, inputs, reduction="mean", batch_first=True):  # noqa: ANN001
    """GradSampleModule's per-sample gradients equal per-sample recomputation, every parameter."""
    with torch.no_grad():
        features = model(*inputs).shape[-1]
    targets = torch.randn(BATCH, features, dtype=DT)
    loss_fn = nn.MSELoss(reduction=reduction)
    expected = microbatch_grad_samples(model, inputs, targets, loss_fn, batch_first)
    actual = wrapped_grad_samples(model, inputs, targets, loss_fn, batch_first)
    assert set(actual) == set(expected) and expected
    for name, truth in expected.items():
        assert truth.abs().sum() > 0, name  # the comparison is not vacuous
        torch.testing.assert_close(actual[name], truth, rtol=1e-9, atol=1e-12, msg=name)


def _sequence(batch_first: bool) -> torch.Tensor:
    x = torch.randn(BATCH, STEPS, INPUT, dtype=DT)
    return x if batch_first else x.transpose(0, 1).contiguous()


RECURRENT = {
    "lstm": (DPLSTM, {}),
    "lstm_proj": (DPLSTM, {"proj_size": 2}),
    "gru": (DPGRU, {}),
    "rnn_relu": (DPRNN, {"nonlinearity": "relu"}),
}


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", RECURRENT.values(), ids=RECURRENT.keys())
def test_bidirectional_two_layer_recurrent_grad_samples_match_microbatches(kind, batch_first):
    layer_cls, extra = kind
    layer = layer_cls(
        INPUT, HIDDEN, num_layers=2, bidirectional=True, batch_first=batch_first, dtype=DT, **extra
    )
    model = _RecurrentFeatures(layer)
    _assert_engine_matches_microbatches(model, (_sequence(batch_first),), batch_first=batch_first)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", RECURRENT.values(), ids=RECURRENT.keys())
def test_packed_sequence_grad_samples_match_microbatches(kind, batch_first):
    layer_cls, extra = kind
    layer = layer_cls(
        INPUT, HIDDEN, num_layers=2, bidirectional=True, batch_first=batch_first, dtype=DT, **extra
    )
    lengths = LENGTHS if batch_first else LENGTHS.reshape(1, -1)
    model = _RecurrentFeatures(layer)
    _assert_engine_matches_microbatches(
        model, (_sequence(batch_first), lengths), batch_first=batch_first
    )


def test_initial_state_grad_samples_match_microbatches():
    model = _RecurrentFeatures(DPLSTM(INPUT, HIDDEN, num_layers=2, batch_first=True, dtype=DT))
    h0, c0 = (torch.randn(BATCH, 2, HIDDEN, dtype=DT) for _ in range(2))
    _assert_engine_matches_microbatches(model, (_sequence(True), LENGTHS, h0, c0))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_recurrent_grad_samples_match_microbatches_for_both_loss_reductions(reduction):
    model = _RecurrentFeatures(DPLSTM(INPUT, HIDDEN, batch_first=True, dtype=DT))
    _assert_engine_matches_microbatches(model, (_sequence(True),), reduction=reduction)


@pytest.mark.parametrize("cell_cls", [DPLSTMCell, DPGRUCell, DPRNNCell])
def test_cell_used_at_every_step_gets_the_sum_of_its_uses(cell_cls):
    model = _CellUnrolled(cell_cls(INPUT, HIDDEN, dtype=DT))
    _assert_engine_matches_microbatches(model, (_sequence(True),))


ATTENTION = {
    "default": {},
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "kdim_vdim": {"kdim": 3, "vdim": 5},
    "no_bias": {"bias": False},
}


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("options", ATTENTION.values(), ids=ATTENTION.keys())
def test_attention_grad_samples_match_microbatches_with_masks(options, batch_first):
    embed, heads, length = 6, 2, 5
    attention = DPMultiheadAttention(embed, heads, batch_first=batch_first, dtype=DT, **options)
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    model = _AttentionFeatures(attention, attn_mask=causal)
    shapes = [embed, options.get("kdim", embed), options.get("vdim", embed)]
    inputs = [torch.randn(BATCH, length, size, dtype=DT) for size in shapes]
    padding = torch.zeros(BATCH, length, dtype=torch.bool)
    padding[0, -2:] = True
    padding[2, -1] = True
    if not batch_first:
        inputs = [t.transpose(0, 1).contiguous() for t in inputs]
        padding = padding.t().contiguous()
    _assert_engine_matches_microbatches(model, (*inputs, padding), batch_first=batch_first)


def test_key_bias_gradient_is_zero_without_extra_keys():
    """Softmax cancels a shift shared by all of a query's scores: the key bias gets no gradient
    (autograd returns rounding noise; the engine's sum audit must accept it, as the attention
    tests above check with the key bias trainable)."""
    attention = DPMultiheadAttention(6, 2, dtype=DT)
    x = torch.randn(5, BATCH, 6, dtype=DT)
    attention(x, x, x)[0].pow(2).sum().backward()
    assert attention.k_proj.bias.grad.abs().max() < 1e-12
    assert attention.q_proj.bias.grad.abs().max() > 1e-3


def test_sequence_bias_norm_sampler_gives_the_squared_norms_of_its_grad_samples():
    layer = SequenceBias(EMBED_FOR_BIAS, batch_first=True, dtype=DT)
    activations = [torch.randn(BATCH, 5, EMBED_FOR_BIAS, dtype=DT)]
    backprops = torch.randn(BATCH, 6, EMBED_FOR_BIAS, dtype=DT)
    grads = get_grad_sampler(layer)(layer, activations, backprops)[layer.bias]
    norms = get_norm_sampler(layer)(layer, activations, backprops)[layer.bias]
    assert grads.shape == (BATCH, 1, 1, EMBED_FOR_BIAS)
    torch.testing.assert_close(norms, grads.flatten(1).pow(2).sum(1))


@pytest.mark.parametrize("layer_batch_first", [True, False])
def test_wrapper_with_the_other_batch_first_is_refused_naming_the_layer_and_the_fix(
    layer_batch_first,
):
    model = nn.Sequential(DPGRU(INPUT, HIDDEN, batch_first=layer_batch_first))
    expected = rf"'0' \(DPGRU\).*GradSampleModule\(model, batch_first={layer_batch_first}\)"
    with pytest.raises(ConfigError, match=expected):
        GradSampleModule(model, batch_first=not layer_batch_first)


def test_attention_whose_length_equals_the_batch_size_is_refused_in_the_other_layout():
    """[L, B, E] with L == B would pass every runtime batch-size check and mix samples."""
    attention = DPMultiheadAttention(6, 2, batch_first=False, dtype=DT)
    with pytest.raises(ConfigError, match="DPMultiheadAttention.*batch_first=False"):
        GradSampleModule(_AttentionFeatures(attention), batch_first=True)


def test_frozen_dp_layer_in_the_other_layout_is_accepted():
    frozen = DPLSTM(INPUT, HIDDEN, batch_first=False).requires_grad_(False)
    GradSampleModule(nn.Sequential(frozen, nn.Linear(HIDDEN, 2)), batch_first=True)
