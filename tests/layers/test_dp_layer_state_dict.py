"""State-dict compatibility holds inside parent models, after copies, and reports bad keys."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from dptrain.layers import DPLSTM, DPGRUCell, DPMultiheadAttention


def _torch_model() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"rnn": nn.LSTM(3, 4, bidirectional=True), "attention": nn.MultiheadAttention(8, 2)}
    )


def _dp_model() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"rnn": DPLSTM(3, 4, bidirectional=True), "attention": DPMultiheadAttention(8, 2)}
    )


def test_nested_dp_layers_export_the_torch_models_keys():
    assert list(_dp_model().state_dict()) == list(_torch_model().state_dict())


def test_torch_model_state_dict_loads_into_nested_dp_layers_and_back():
    source, private, target = _torch_model(), _dp_model(), _torch_model()
    private.load_state_dict(source.state_dict())
    target.load_state_dict(private.state_dict())
    for key, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DPLSTM(3, 4),
        lambda: DPMultiheadAttention(4, 2, add_bias_kv=True),
        lambda: DPGRUCell(3, 4),
    ],
)
def test_deep_copied_and_pickled_layers_keep_the_torch_keys(make):
    layer = make()
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    expected = list(layer.state_dict())
    assert list(copy.deepcopy(layer).state_dict()) == expected == list(restored.state_dict())


def test_strict_load_reports_missing_and_unexpected_keys_by_their_torch_names():
    state = nn.LSTM(3, 4).state_dict()
    state["weight_ih_l7"] = state.pop("weight_ih_l0")
    with pytest.raises(
        RuntimeError, match=r'Missing.*"rnn.weight_ih_l0".*\n.*Unexpected.*"rnn.weight_ih_l7"'
    ):
        model = nn.ModuleDict({"rnn": DPLSTM(3, 4)})
        model.load_state_dict({f"rnn.{key}": value for key, value in state.items()})


def test_attention_missing_stacked_projection_is_reported_once_by_its_torch_name():
    state = nn.MultiheadAttention(4, 2).state_dict()
    del state["in_proj_weight"]
    result = DPMultiheadAttention(4, 2).load_state_dict(state, strict=False)
    assert result.missing_keys == ["in_proj_weight"] and result.unexpected_keys == []
