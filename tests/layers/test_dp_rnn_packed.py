"""PackedSequence inputs: the outputs, final states and gradients of torch's packed layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dptrain.layers import DPGRU, DPLSTM, DPRNN

KINDS = {
    "rnn": (nn.RNN, DPRNN, {}),
    "lstm": (nn.LSTM, DPLSTM, {}),
    "lstm_proj": (nn.LSTM, DPLSTM, {"proj_size": 2}),
    "gru": (nn.GRU, DPGRU, {}),
}
INPUT, HIDDEN = 3, 4
LENGTHS = torch.tensor([2, 5, 1, 4])  # unsorted on purpose


def _padded(batch_first: bool, lengths: torch.Tensor = LENGTHS) -> torch.Tensor:
    batch, steps = len(lengths), int(lengths.max())
    x = torch.randn(batch, steps, INPUT, dtype=torch.float64)
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("enforce_sorted", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_packed_input_gives_torchs_packed_output_and_final_states(
    kind, batch_first, enforce_sorted, load_pair, assert_same
):
    torch_cls, dp_cls, extra = kind
    lengths = LENGTHS.sort(descending=True).values if enforce_sorted else LENGTHS
    reference, private = load_pair(
        torch_cls,
        dp_cls,
        INPUT,
        HIDDEN,
        num_layers=2,
        bidirectional=True,
        batch_first=batch_first,
        **extra,
    )
    packed = pack_padded_sequence(
        _padded(batch_first, lengths), lengths, batch_first, enforce_sorted
    )
    assert_same(private(packed), reference(packed))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_packed_input_with_initial_states_matches_torch(kind, load_pair, assert_same):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(torch_cls, dp_cls, INPUT, HIDDEN, bidirectional=True, **extra)
    packed = pack_padded_sequence(_padded(False), LENGTHS, enforce_sorted=False)
    h0 = torch.randn(2, len(LENGTHS), reference.proj_size or HIDDEN, dtype=torch.float64)
    hx = (
        (h0, torch.randn(2, len(LENGTHS), HIDDEN, dtype=torch.float64))
        if reference.mode == "LSTM"
        else h0
    )
    assert_same(private(packed, hx), reference(packed, hx))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_parameter_gradients_of_packed_input_match_torch(kind, load_pair):
    torch_cls, dp_cls, extra = kind
    reference, private = load_pair(
        torch_cls, dp_cls, INPUT, HIDDEN, num_layers=2, bidirectional=True, **extra
    )
    packed = pack_padded_sequence(_padded(False), LENGTHS, enforce_sorted=False)
    for layer in (reference, private):
        output, state = layer(packed)
        hidden = state[0] if isinstance(state, tuple) else state
        (output.data.pow(2).sum() + hidden.sum()).backward()
    private_grads = {name: p.grad for name, p in private.named_parameters()}
    expected = {name: grad for name, grad in reference.state_dict(keep_vars=True).items()}
    for torch_name, param in expected.items():
        internal = private._torch_to_internal({torch_name: None})
        (internal_name,) = internal
        torch.testing.assert_close(private_grads[internal_name], param.grad, rtol=1e-10, atol=1e-12)
