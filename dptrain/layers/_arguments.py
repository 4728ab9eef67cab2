"""Constructor-argument checks shared by the DP recurrent layers and cells."""

from __future__ import annotations

from dptrain.errors import ConfigError


def refuse_projection(name: str, proj_size: int) -> None:
    """Only LSTMs have an output projection (as in torch)."""
    if proj_size != 0:
        raise ConfigError(
            f"{name}: `proj_size`={proj_size!r} is only supported by DPLSTM (as in torch); "
            "remove it, or use DPLSTM."
        )


def elman_mode(name: str, nonlinearity: str) -> str:
    """The cell mode (``RNN_TANH`` / ``RNN_RELU``) of an Elman layer's ``nonlinearity``."""
    if nonlinearity not in ("tanh", "relu"):
        raise ConfigError(f"{name}: `nonlinearity` must be 'tanh' or 'relu', got {nonlinearity!r}.")
    return f"RNN_{nonlinearity.upper()}"


def check_rnn_args(
    name: str,
    input_size: int,
    hidden_size: int,
    num_layers: int = 1,
    dropout: float = 0.0,
    proj_size: int = 0,
) -> None:
    """Raise ConfigError naming the first constructor argument that cannot be used."""
    checks = [
        (
            isinstance(input_size, int) and input_size > 0,
            "input_size",
            input_size,
            "a positive int",
        ),
        (
            isinstance(hidden_size, int) and hidden_size > 0,
            "hidden_size",
            hidden_size,
            "a positive int",
        ),
        (
            isinstance(num_layers, int) and num_layers > 0,
            "num_layers",
            num_layers,
            "a positive int",
        ),
        (
            isinstance(dropout, (int, float)) and 0 <= dropout <= 1,
            "dropout",
            dropout,
            "a number in [0, 1]",
        ),
        (
            isinstance(proj_size, int) and 0 <= proj_size < max(hidden_size, 1),
            "proj_size",
            proj_size,
            "0 (no projection) or an int smaller than hidden_size",
        ),
    ]
    for ok, argument, value, expected in checks:
        if not ok:
            raise ConfigError(f"{name}: `{argument}`={value!r} is invalid; use {expected}.")
