"""DPRNN / DPLSTM / DPGRU compute exactly what the torch layers compute, same state_dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.layers import DPGRU, DPLSTM, DPRNN

KINDS = {
    "rnn_tanh": (nn.RNN, DPRNN, {}),
    "rnn_relu": (nn.RNN, DPRNN, {"nonlinearity": "relu"}),
    "lstm": (nn.LSTM, DPLSTM, {}),
    "lstm_proj": (nn.LSTM, DPLSTM, {"proj_size": 2}),
    "gru": (nn.GRU, DPGRU, {}),
}
OPTIONS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "bidirectional_two_layers": {"bidirectional": True, "num_layers": 2},
    "no_bias": {"bias": False},
    "three_layers_bidirectional_batch_first": {
        "num_layers": 3,
        "bidirectional": True,
        "batch_first": True,
    },
}
INPUT, HIDDEN, BATCH, STEPS = 3, 4, 2, 5


def _inputs(batch_first: bool) -> torch.Tensor:
    shape = (BATCH, STEPS, INPUT) if batch_first else (STEPS, BATCH, INPUT)
    return torch.randn(shape, dtype=torch.float64)


def _initial_state(layer: nn.Module) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    count = layer.num_layers * (2 if layer.bidirectional else 1)
    h0 = torch.randn(count, BATCH, layer.proj_size or layer.hidden_size, dtype=torch.float64)
    if layer.mode == "LSTM":
        return h0, torch.randn(count, BATCH, layer.hidden_size, dtype=torch.float64)
    return h0


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_dp_layer_matches_torch_layer_after_loading_its_state_dict(
    kind, options, load_pair, assert_same
):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(torch_cls, dp_cls, INPUT, HIDDEN, **extra, **options)
    x = _inputs(options.get("batch_first", False))
    assert_same(private(x), reference(x))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_torch_layer_matches_dp_layer_after_loading_the_dp_state_dict(kind, options, assert_same):
    torch_cls, dp_cls, extra = kind
    private = dp_cls(INPUT, HIDDEN, dtype=torch.float64, **extra, **options)
    reference = torch_cls(INPUT, HIDDEN, dtype=torch.float64, **extra, **options)
    reference.load_state_dict(private.state_dict())
    x = _inputs(options.get("batch_first", False))
    assert_same(reference(x), private(x))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_state_dict_keys_equal_the_torch_layer_keys_in_order(kind):
    torch_cls, dp_cls, extra = kind
    options = {"num_layers": 2, "bidirectional": True, **extra}
    assert list(dp_cls(INPUT, HIDDEN, **options).state_dict()) == list(
        torch_cls(INPUT, HIDDEN, **options).state_dict()
    )


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_initial_states_are_used_as_torch_uses_them(kind, load_pair, assert_same):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(
        torch_cls, dp_cls, INPUT, HIDDEN, num_layers=2, bidirectional=True, **extra
    )
    x, hx = _inputs(False), _initial_state(reference)
    assert_same(private(x, hx), reference(x, hx))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_unbatched_input_matches_torch(kind, load_pair, assert_same):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(torch_cls, dp_cls, INPUT, HIDDEN, bidirectional=True, **extra)
    x = torch.randn(STEPS, INPUT, dtype=torch.float64)
    assert_same(private(x), reference(x))


def test_dropout_between_layers_is_inactive_in_eval_mode(load_pair, assert_same):
    reference, private = load_pair(nn.LSTM, DPLSTM, INPUT, HIDDEN, num_layers=2, dropout=0.5)
    reference.eval(), private.eval()
    x = _inputs(False)
    assert_same(private(x), reference(x))


def test_dropout_between_layers_changes_training_outputs():
    private = DPGRU(INPUT, HIDDEN, num_layers=2, dropout=0.5, dtype=torch.float64)
    x = _inputs(False)
    training_output, _ = private(x)
    private.eval()
    assert not torch.allclose(training_output, private(x)[0])


def test_dropout_is_not_applied_after_the_last_layer():
    private = DPLSTM(INPUT, HIDDEN, num_layers=1, dropout=0.5, dtype=torch.float64)
    x = _inputs(False)
    training_output, _ = private(x)
    private.eval()
    torch.testing.assert_close(training_output, private(x)[0])


def test_input_projection_runs_once_on_the_whole_sequence():
    private = DPLSTM(INPUT, HIDDEN, batch_first=True)
    shapes = []
    private.ih_l0.register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape))
    )
    private(torch.randn(BATCH, STEPS, INPUT))
    assert shapes == [(BATCH, STEPS, INPUT)]


@pytest.mark.parametrize("batch_first", [True, False])
def test_hidden_projection_runs_once_per_step_with_the_batch_where_batch_first_says(batch_first):
    private = DPGRU(INPUT, HIDDEN, batch_first=batch_first)
    shapes = []
    private.hh_l0.register_forward_hook(
        lambda module, args, out: shapes.append(tuple(args[0].shape))
    )
    private(torch.randn(BATCH, STEPS, INPUT) if batch_first else torch.randn(STEPS, BATCH, INPUT))
    expected = (BATCH, 1, HIDDEN) if batch_first else (1, BATCH, HIDDEN)
    assert shapes == [expected] * STEPS


def test_every_parameter_lives_in_a_linear_submodule():
    private = DPLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, proj_size=2)
    owners = {
        type(module) for module in private.modules() if list(module.parameters(recurse=False))
    }
    assert all(issubclass(owner, nn.Linear) for owner in owners)
