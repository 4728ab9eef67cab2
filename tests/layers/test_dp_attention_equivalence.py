"""DPMultiheadAttention computes exactly what nn.MultiheadAttention computes, same state_dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.layers import DPMultiheadAttention

EMBED, HEADS, BATCH, TARGET, SOURCE = 6, 2, 3, 4, 5
OPTIONS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv_zero_attn_batch_first": {
        "add_bias_kv": True,
        "add_zero_attn": True,
        "batch_first": True,
    },
    "kdim_vdim": {"kdim": 3, "vdim": 5},
    "no_bias": {"bias": False},
}


def _masks() -> dict[str, dict[str, torch.Tensor]]:
    padding = torch.zeros(BATCH, SOURCE, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.ones(TARGET, SOURCE, dtype=torch.bool).triu(1)
    additive = torch.randn(BATCH * HEADS, TARGET, SOURCE, dtype=torch.float64)
    return {
        "none": {},
        "key_padding": {"key_padding_mask": padding},
        "bool_attn_mask": {"attn_mask": causal},
        "float_3d_attn_mask": {"attn_mask": additive},
        "both": {"attn_mask": causal, "key_padding_mask": padding},
        "float_key_padding": {"key_padding_mask": padding.double() * -2.0},
    }


MASKS = _masks()


def _inputs(options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query = torch.randn(TARGET, BATCH, EMBED, dtype=torch.float64)
    key = torch.randn(SOURCE, BATCH, options.get("kdim", EMBED), dtype=torch.float64)
    value = torch.randn(SOURCE, BATCH, options.get("vdim", EMBED), dtype=torch.float64)
    if options.get("batch_first"):
        return query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    return query, key, value


@pytest.mark.parametrize("masks", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_dp_attention_matches_torch_after_loading_its_state_dict(
    options, masks, load_pair, assert_same
):
    reference, private = load_pair(
        nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS, **options
    )
    inputs = _inputs(options)
    assert_same(private(*inputs, **masks), reference(*inputs, **masks))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_torch_attention_matches_after_loading_the_dp_state_dict(options, assert_same):
    private = DPMultiheadAttention(EMBED, HEADS, dtype=torch.float64, **options)
    reference = nn.MultiheadAttention(EMBED, HEADS, dtype=torch.float64, **options)
    reference.load_state_dict(private.state_dict())
    inputs = _inputs(options)
    assert_same(reference(*inputs), private(*inputs))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_state_dict_keys_equal_the_torch_keys_in_order(options):
    private = DPMultiheadAttention(EMBED, HEADS, **options)
    assert list(private.state_dict()) == list(
        nn.MultiheadAttention(EMBED, HEADS, **options).state_dict()
    )


def test_per_head_weights_match_torch_when_not_averaged(load_pair, assert_same):
    reference, private = load_pair(nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS)
    inputs = _inputs({})
    assert_same(
        private(*inputs, average_attn_weights=False), reference(*inputs, average_attn_weights=False)
    )


def test_need_weights_false_returns_no_weights_and_the_same_output(load_pair):
    reference, private = load_pair(nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS)
    inputs = _inputs({})
    output, weights = private(*inputs, need_weights=False)
    assert weights is None
    torch.testing.assert_close(output, reference(*inputs, need_weights=False)[0])


def test_unbatched_inputs_match_torch(load_pair, assert_same):
    reference, private = load_pair(
        nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS, add_bias_kv=True
    )
    query, key, value = (t[:, 0] for t in _inputs({}))
    padding = torch.tensor([False, False, False, True, True])
    assert_same(
        private(query, key, value, key_padding_mask=padding),
        reference(query, key, value, key_padding_mask=padding),
    )


def test_is_causal_with_a_causal_mask_matches_torch(load_pair, assert_same):
    reference, private = load_pair(nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS)
    x = torch.randn(TARGET, BATCH, EMBED, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(TARGET, dtype=torch.float64)
    assert_same(
        private(x, x, x, attn_mask=causal, is_causal=True),
        reference(x, x, x, attn_mask=causal, is_causal=True),
    )


def test_is_causal_without_a_mask_builds_the_causal_mask():
    private = DPMultiheadAttention(EMBED, HEADS, dtype=torch.float64)
    x = torch.randn(TARGET, BATCH, EMBED, dtype=torch.float64)
    causal = torch.ones(TARGET, TARGET, dtype=torch.bool).triu(1)
    torch.testing.assert_close(private(x, x, x, is_causal=True), private(x, x, x, attn_mask=causal))


def test_attention_dropout_acts_in_training_only():
    private = DPMultiheadAttention(EMBED, HEADS, dropout=0.5, dtype=torch.float64)
    inputs = _inputs({})
    training_output, _ = private(*inputs)
    private.eval()
    evaluation_output, _ = private(*inputs)
    assert not torch.allclose(training_output, evaluation_output)
    torch.testing.assert_close(evaluation_output, private(*inputs)[0])


def test_training_with_dropout_matches_torch_under_the_same_seed_weights_included(
    load_pair, assert_same
):
    """Both draw the dropout mask on the same [B*H, L, S] weights, so one seed gives one mask;
    like torch, the returned weights are the dropped ones the output was computed with."""
    reference, private = load_pair(
        nn.MultiheadAttention, DPMultiheadAttention, EMBED, HEADS, dropout=0.5
    )
    inputs = _inputs({})
    torch.manual_seed(0)
    expected = reference(*inputs, average_attn_weights=False)
    torch.manual_seed(0)
    assert_same(private(*inputs, average_attn_weights=False), expected)


def test_bias_k_and_bias_v_read_like_torch_attributes():
    private = DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    assert private.bias_k.shape == (1, 1, EMBED) and private.bias_v.shape == (1, 1, EMBED)
    assert DPMultiheadAttention(EMBED, HEADS).bias_k is None


def test_transformer_encoder_layer_with_dp_attention_matches_torch_in_training_and_inference(
    assert_same,
):
    reference = nn.TransformerEncoderLayer(
        EMBED, HEADS, 8, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    private = nn.TransformerEncoderLayer(
        EMBED, HEADS, 8, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    private.self_attn = DPMultiheadAttention(EMBED, HEADS, batch_first=True, dtype=torch.float64)
    private.load_state_dict(reference.state_dict())
    x = torch.randn(BATCH, SOURCE, EMBED, dtype=torch.float64)
    assert_same(private(x), reference(x))
    reference.eval(), private.eval()
    with torch.no_grad():
        assert_same(private(x), reference(x))
