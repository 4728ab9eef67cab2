"""Bad arguments and inputs to the DP layers raise ConfigError naming what to change."""

from __future__ import annotations

import pytest
import torch

from dptrain.errors import ConfigError
from dptrain.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: DPLSTM(0, 4), "input_size"),
        (lambda: DPLSTM(3, -1), "hidden_size"),
        (lambda: DPGRU(3, 4, num_layers=0), "num_layers"),
        (lambda: DPRNN(3, 4, dropout=1.5), "dropout"),
        (lambda: DPLSTM(3, 4, proj_size=4), "proj_size"),
        (lambda: DPGRU(3, 4, proj_size=2), "proj_size"),
        (lambda: DPRNN(3, 4, proj_size=2), "proj_size"),
        (lambda: DPRNN(3, 4, nonlinearity="sigmoid"), "nonlinearity"),
        (lambda: DPMultiheadAttention(6, 4), "num_heads"),
        (lambda: DPMultiheadAttention(0, 1), "embed_dim"),
        (lambda: DPMultiheadAttention(6, 2, dropout=-0.1), "dropout"),
    ],
)
def test_invalid_constructor_argument_raises_config_error_naming_it(make, argument):
    with pytest.raises(ConfigError, match=argument):
        make()


def test_input_with_the_wrong_feature_size_names_input_size():
    with pytest.raises(ConfigError, match="input_size=3"):
        DPLSTM(3, 4)(torch.randn(5, 2, 7))


def test_initial_state_of_the_wrong_shape_names_hx_and_the_expected_shape():
    with pytest.raises(ConfigError, match=r"hx.*\[1, 2, 4\]"):
        DPGRU(3, 4)(torch.randn(5, 2, 3), torch.randn(1, 3, 4))


def test_lstm_given_a_single_initial_tensor_asks_for_h0_and_c0():
    with pytest.raises(ConfigError, match=r"\(h0, c0\)"):
        DPLSTM(3, 4)(torch.randn(5, 2, 3), torch.randn(1, 2, 4))


def test_attention_query_of_the_wrong_size_names_query_and_batch_first():
    attention = DPMultiheadAttention(6, 2)
    with pytest.raises(ConfigError, match="query.*batch_first"):
        attention(torch.randn(4, 2, 5), torch.randn(4, 2, 6), torch.randn(4, 2, 6))


def test_attention_integer_mask_names_the_mask():
    attention = DPMultiheadAttention(6, 2)
    x = torch.randn(4, 2, 6)
    with pytest.raises(ConfigError, match="attn_mask"):
        attention(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int64))
