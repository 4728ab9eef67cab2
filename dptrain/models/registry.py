"""Name -> model constructor registry, and the shape of each model's input.

The Hydra configs (``_target_: dptrain.models.get_model``, ``name: mnist_cnn``), the tests and
``scripts/benchmark_e2e.py`` all build models through :func:`get_model`, so there is exactly one
definition of each architecture.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.cnn import Cifar10CNN, MnistCNN
from dptrain.models.mlp import DigitsMLP
from dptrain.models.resnet import resnet18
from dptrain.models.text import NUM_SPECIAL_TOKENS, ImdbEmbedding, ImdbLSTM
from dptrain.models.transformer import Transformer

#: Registry name -> constructor (a class or a factory function) taking keyword arguments only.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "digits_mlp": DigitsMLP,
    "mnist_cnn": MnistCNN,
    "cifar10_cnn": Cifar10CNN,
    "imdb_embedding": ImdbEmbedding,
    "imdb_lstm": ImdbLSTM,
    "resnet18": resnet18,
    "transformer": Transformer,
}


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name`` with constructor keyword arguments ``kwargs``.

    Raises:
        ConfigError: unknown ``name``, or a keyword the constructor does not accept.
    """
    constructor = _constructor(name)
    accepted = inspect.signature(constructor).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"model {name!r} has no argument(s) {unknown}; remove them from the model config. "
            f"Accepted arguments: {sorted(accepted)}."
        )
    return constructor(**kwargs)


@dataclass(frozen=True)
class InputSpec:
    """What one sample looks like for a model.

    Attributes:
        shape: per-sample input shape (no batch dimension), e.g. ``(1, 28, 28)`` or ``(256,)``.
        num_classes: label range ``[0, num_classes)``.
        vocab_size: when set, inputs are int64 token ids in ``[0, vocab_size)``; else float
            features drawn from N(0, 1).
        per_token_targets: labels are ``[B, *shape]`` (language modelling), else ``[B]``.
    """

    shape: tuple[int, ...]
    num_classes: int
    vocab_size: int | None = None
    per_token_targets: bool = False

    def batch(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(inputs [batch_size, *shape], labels)`` of the right dtypes (for tests/benchmarks)."""
        full = (batch_size, *self.shape)
        if self.vocab_size is None:
            x = torch.randn(full, generator=generator, dtype=dtype)
        else:
            x = torch.randint(self.vocab_size, full, generator=generator)
        y_shape = full if self.per_token_targets else (batch_size,)
        y = torch.randint(self.num_classes, y_shape, generator=generator)
        return x.to(device), y.to(device)


def input_spec(name: str, input_length: int | None = None, **kwargs: Any) -> InputSpec:
    """The input of model ``name`` built with ``kwargs`` (the same kwargs as :func:`get_model`).

    Args:
        input_length: sequence length T for the token models (default: 256 for IMDb, the model's
            ``seq_len`` for the transformer); ignored by image/feature models.
    """
    _constructor(name)
    defaults = {
        key: p.default for key, p in inspect.signature(MODELS[name]).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    args = {**defaults, **kwargs}
    return _INPUTS[name](args, input_length)


def _constructor(name: str) -> Callable[..., nn.Module]:
    """``MODELS[name]`` or a ConfigError listing the registered names."""
    if name not in MODELS:
        raise ConfigError(
            f"unknown model name {name!r}; set model.name to one of {sorted(MODELS)}."
        )
    return MODELS[name]


def _imdb_input(args: dict[str, Any], length: int | None) -> InputSpec:
    """Token ids over the IMDb vocabulary (+4 special tokens), 256 tokens by default."""
    return InputSpec((length or 256,), args["num_classes"], args["vocab_size"] + NUM_SPECIAL_TOKENS)


def _transformer_input(args: dict[str, Any], length: int | None) -> InputSpec:
    """Token ids; next-token targets for the LM head, one label per sequence otherwise."""
    lm = args["head"] == "lm"
    classes = args["vocab_size"] if lm else args["num_classes"]
    return InputSpec((length or args["seq_len"],), classes, args["vocab_size"], per_token_targets=lm)


_INPUTS: dict[str, Callable[[dict[str, Any], int | None], InputSpec]] = {
    "digits_mlp": lambda a, _: InputSpec((a["in_features"],), a["num_classes"]),
    "mnist_cnn": lambda a, _: InputSpec((1, 28, 28), a["num_classes"]),
    "cifar10_cnn": lambda a, _: InputSpec((3, 32, 32), a["num_classes"]),
    "imdb_embedding": _imdb_input,
    "imdb_lstm": _imdb_input,
    "resnet18": lambda a, _: InputSpec((a["in_channels"], 32, 32), a["num_classes"]),
    "transformer": _transformer_input,
}
