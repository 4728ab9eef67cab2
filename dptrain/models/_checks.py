"""Constructor-argument checks shared by the model definitions (raise ConfigError, never assert)."""

from dptrain.errors import ConfigError


def require_positive(model: str, **values: int | float) -> None:
    """Raise ConfigError unless every named value is > 0.

    Args:
        model: registry name of the model, used in the message (e.g. ``"transformer"``).
        values: ``argument name -> value`` pairs to check.
    """
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(
                f"model {model!r}: argument {name}={value!r} must be a positive number; "
                f"set model.{name} to a value > 0."
            )


def require_fraction(model: str, name: str, value: float) -> None:
    """Raise ConfigError unless ``0 <= value < 1`` (dropout probabilities)."""
    if not 0.0 <= value < 1.0:
        raise ConfigError(
            f"model {model!r}: argument {name}={value!r} must lie in [0, 1); "
            f"set model.{name} to e.g. 0.0 (no dropout) or 0.1."
        )
