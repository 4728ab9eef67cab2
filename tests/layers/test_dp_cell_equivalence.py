"""DPRNNCell / DPLSTMCell / DPGRUCell compute what the torch cells compute, same state_dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.layers import DPGRUCell, DPLSTMCell, DPRNNCell

KINDS = {
    "rnn_tanh": (nn.RNNCell, DPRNNCell, {}),
    "rnn_relu": (nn.RNNCell, DPRNNCell, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTMCell, DPLSTMCell, {}),
    "gru": (nn.GRUCell, DPGRUCell, {}),
    "gru_no_bias": (nn.GRUCell, DPGRUCell, {"bias": False}),
}
INPUT, HIDDEN, BATCH = 3, 4, 2


def _state(cell: nn.Module, *batch: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(*batch, HIDDEN, dtype=torch.float64)
    return (
        (h, torch.randn(*batch, HIDDEN, dtype=torch.float64))
        if isinstance(cell, nn.LSTMCell)
        else h
    )


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_dp_cell_matches_torch_cell_with_and_without_a_state(kind, load_pair, assert_same):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(torch_cls, dp_cls, INPUT, HIDDEN, **extra)
    x, hx = torch.randn(BATCH, INPUT, dtype=torch.float64), _state(reference, BATCH)
    assert_same(private(x), reference(x))
    assert_same(private(x, hx), reference(x, hx))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_unbatched_cell_input_matches_torch(kind, load_pair, assert_same):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(torch_cls, dp_cls, INPUT, HIDDEN, **extra)
    x, hx = torch.randn(INPUT, dtype=torch.float64), _state(reference)
    assert_same(private(x, hx), reference(x, hx))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_torch_cell_loads_the_dp_cell_state_dict_with_the_same_keys(kind, assert_same):
    torch_cls, dp_cls, extra = kind
    private = dp_cls(INPUT, HIDDEN, dtype=torch.float64, **extra)
    reference = torch_cls(INPUT, HIDDEN, dtype=torch.float64, **extra)
    assert list(private.state_dict()) == list(reference.state_dict())
    reference.load_state_dict(private.state_dict())
    x = torch.randn(BATCH, INPUT, dtype=torch.float64)
    assert_same(reference(x), private(x))


def test_cell_state_of_the_wrong_shape_names_hx():
    with pytest.raises(ConfigError, match=r"hx.*\(h, c\)"):
        DPLSTMCell(INPUT, HIDDEN)(torch.randn(BATCH, INPUT), torch.randn(BATCH, HIDDEN))
