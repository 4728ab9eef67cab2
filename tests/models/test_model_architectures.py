"""Architectures: parameter counts of the paper's models, output shapes, registry and errors."""

import pytest
import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models import MODELS, get_model, input_spec
from dptrain.models.registry import _INPUTS

from tests.models.small_configs import SMALL


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("mnist_cnn", 26_010),
        ("cifar10_cnn", 605_226),
        ("imdb_embedding", 160_098),
        ("imdb_lstm", 1_081_402),
        ("digits_mlp", 4_810),
        ("resnet18", 11_181_642),
    ],
)
def test_paper_models_have_the_published_parameter_counts(name: str, count: int) -> None:
    assert n_params(get_model(name)) == count


def test_imdb_lstm_has_as_many_parameters_as_with_torch_lstm() -> None:
    model = get_model("imdb_lstm")
    torch_lstm = nn.LSTM(100, 100, batch_first=True)
    assert n_params(model.lstm) == n_params(torch_lstm)


def test_imdb_lstm_gives_the_same_output_with_torch_lstm_loaded_from_its_weights() -> None:
    model = get_model("imdb_lstm", **SMALL["imdb_lstm"]).double()
    x, _ = input_spec("imdb_lstm", input_length=5, **SMALL["imdb_lstm"]).batch(3)
    expected = model(x)
    torch_lstm = nn.LSTM(8, 6, batch_first=True).double()
    torch_lstm.load_state_dict(model.lstm.state_dict())
    model.lstm = torch_lstm
    torch.testing.assert_close(model(x), expected)


def test_registry_and_input_specs_cover_the_same_names() -> None:
    assert set(MODELS) == set(_INPUTS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_shape_matches_the_input_spec(name: str) -> None:
    model = get_model(name, **SMALL[name])
    spec = input_spec(name, input_length=6, **SMALL[name])
    x, y = spec.batch(2)
    out = model(x)
    expected = (*y.shape, spec.num_classes)
    assert tuple(out.shape) == expected


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cross_entropy_backward_reaches_every_parameter(name: str) -> None:
    model = get_model(name, **SMALL[name])
    x, y = input_spec(name, input_length=4, **SMALL[name]).batch(2)
    out = model(x)
    nn.functional.cross_entropy(out.flatten(0, -2), y.flatten()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_resnet18_has_no_batchnorm() -> None:
    model = get_model("resnet18")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert all(m.num_groups == 32 for m in model.modules() if isinstance(m, nn.GroupNorm))


def test_resnet18_accepts_single_channel_images() -> None:
    model = get_model("resnet18", num_classes=4, in_channels=1)
    x, _ = input_spec("resnet18", num_classes=4, in_channels=1).batch(2)
    assert x.shape == (2, 1, 32, 32)
    assert model(x).shape == (2, 4)


def test_transformer_is_causal() -> None:
    model = get_model("transformer", **SMALL["transformer"]).double().eval()
    x, _ = input_spec("transformer", **SMALL["transformer"]).batch(1)
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 40
    torch.testing.assert_close(model(x)[:, :-1], model(changed)[:, :-1])
    assert not torch.allclose(model(x)[:, -1], model(changed)[:, -1])


def test_transformer_tied_head_shares_the_token_embedding() -> None:
    model = get_model("transformer", tie_weights=True, **SMALL["transformer"])
    assert model.head.weight is model.tok_emb.weight


def test_transformer_classification_head_outputs_one_row_per_sequence() -> None:
    kwargs = {**SMALL["transformer"], "head": "classification", "num_classes": 3}
    x, y = input_spec("transformer", **kwargs).batch(2)
    assert get_model("transformer", **kwargs)(x).shape == (2, 3)
    assert y.shape == (2,)


def test_transformer_rejects_sequences_longer_than_seq_len() -> None:
    model = get_model("transformer", **SMALL["transformer"])
    with pytest.raises(ConfigError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"n_embd": 10, "n_head": 3}, "n_head"),
        ({"head": "pooler"}, "head"),
        ({"head": "classification", "tie_weights": True}, "tie_weights"),
        ({"dropout": 1.0}, "dropout"),
        ({"n_layer": 0}, "n_layer"),
    ],
)
def test_transformer_rejects_bad_arguments_naming_them(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        get_model("transformer", **{**SMALL["transformer"], **kwargs})


def test_get_model_rejects_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="mnist_cnn"):
        get_model("mnist_cnnn")


def test_get_model_rejects_unknown_arguments_naming_them() -> None:
    with pytest.raises(ConfigError, match="num_clases"):
        get_model("mnist_cnn", num_clases=3)


def test_digits_mlp_rejects_non_positive_hidden_size() -> None:
    with pytest.raises(ConfigError, match=r"hidden_sizes\[1\]"):
        get_model("digits_mlp", hidden_sizes=(8, 0))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_empty_batch_runs_forward_and_backward(name: str) -> None:
    """Poisson sampling draws empty batches: every model takes B = 0 (zero gradients)."""
    model = get_model(name, **SMALL[name])
    spec = input_spec(name, input_length=4, **SMALL[name])
    x, y = spec.batch(0)
    out = model(x)
    assert tuple(out.shape) == (*y.shape, spec.num_classes)
    nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum").backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
