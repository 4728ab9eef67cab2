"""Noise strategies: independent (DP-SGD), banded and BLT (matrix-factorization mechanisms).

A strategy is the lower-triangular Toeplitz matrix C of a matrix-factorization mechanism: the
model receives, at step t, the noise (C^{-1} Z)_t, with Z the i.i.d. Gaussian draws DP-SGD
makes, so that much of the noise cancels in the running sum of the updates. Each strategy is a
frozen dataclass with `name`, `toeplitz_column(T)`, `to_dict()` / `from_dict()` and
`generator()` (the buffered noise generator, `base.NoiseGenerator`).

    Independent()                          C = I (the default: today's DP-SGD, bit for bit)
    Banded.optimised(bands=4, num_steps=T)  b-banded, optimised for the running sum
    Blt.optimised(buffers=3, num_steps=T)   buffered linear Toeplitz with d buffers

`strategy_for(kind, num_steps, ...)` builds one from the config's `privacy.noise` keys;
`strategy_from_dict` reads back a recorded one; `check_compatible` holds the rules a correlated
strategy imposes on the rest of the plan.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from dptrain.errors import ConfigError
from dptrain.privacy.noise.banded import Banded
from dptrain.privacy.noise.base import NoiseGenerator, NoiseStrategy
from dptrain.privacy.noise.blt import Blt
from dptrain.privacy.noise.independent import Independent

#: privacy.noise's values.
NOISE_KINDS = ("independent", "banded", "blt")
_CLASSES = {"independent": Independent, "banded": Banded, "blt": Blt}
#: Defaults of privacy.noise_bands / privacy.noise_buffers when left null.
DEFAULT_BUFFERS = 3

__all__ = ["Banded", "Blt", "DEFAULT_BUFFERS", "Independent", "NOISE_KINDS", "NoiseGenerator",
           "NoiseStrategy", "check_compatible", "check_noise_keys", "noise_class", "strategy_for", "strategy_from_dict"]


def noise_class(kind: str, key: str = "privacy.noise") -> type:
    """The strategy class of privacy.noise=`kind`; ConfigError naming `key` otherwise."""
    if kind not in _CLASSES:
        raise ConfigError(f"{key}={kind!r} is unknown: use one of {list(NOISE_KINDS)}.")
    return _CLASSES[kind]


def strategy_from_dict(data: Mapping[str, Any] | NoiseStrategy | None) -> NoiseStrategy:
    """The strategy `to_dict()` wrote (a strategy object as is; None: Independent)."""
    if data is None:
        return Independent()
    if not isinstance(data, Mapping):
        if data.__class__ not in _CLASSES.values():
            raise ConfigError(f"noise_strategy={data!r} is not a noise strategy: use "
                              "dptrain.privacy.noise.Independent(), Banded.optimised(...) or "
                              "Blt.optimised(...).")
        return data
    name = data.get("name")
    if name not in _CLASSES:
        raise ConfigError(f"the recorded noise strategy {dict(data)!r} names an unknown kind "
                          f"{name!r}; dptrain knows {list(NOISE_KINDS)}.")
    try:
        return _CLASSES[name].from_dict(data)
    except (KeyError, TypeError) as error:
        raise ConfigError(f"the recorded {name} noise strategy {dict(data)!r} cannot be read "
                          f"({type(error).__name__}: {error}).") from error


def strategy_for(kind: str, num_steps: int, *, bands: int | None = None,
                 buffers: int | None = None, steps_per_epoch: int = 1,
                 momentum: float = 0.0) -> NoiseStrategy:
    """The strategy privacy.noise=`kind` asks for, optimised for a run of `num_steps` steps.

    banded: `bands` bands (privacy.noise_bands; required), optimised for the running sum under
    single participation per band window. blt: `buffers` buffers (privacy.noise_buffers; default
    DEFAULT_BUFFERS), optimised for an example taking part once per epoch of `steps_per_epoch`
    steps (min separation steps_per_epoch, ceil(T / steps_per_epoch) participations). The
    optimisation target only affects utility: the accounting charges the resulting column.
    ConfigError naming the key of any value that cannot be used.
    """
    check_noise_keys(kind, bands=bands, buffers=buffers)
    if kind == "independent":
        return Independent()
    if kind == "banded":
        return Banded.optimised(bands, num_steps, momentum=momentum)
    min_sep = max(1, min(int(steps_per_epoch), num_steps))
    return Blt.optimised(DEFAULT_BUFFERS if buffers is None else buffers, num_steps,
                         min_sep=min_sep, max_participations=math.ceil(num_steps / min_sep),
                         momentum=momentum)


def check_noise_keys(kind: str, *, bands: int | None = None, buffers: int | None = None,
                     keys: tuple[str, str, str] = ("privacy.noise", "privacy.noise_bands",
                                                   "privacy.noise_buffers")) -> str:
    """`kind` (privacy.noise) once its counts are checked: ConfigError for an unknown kind, a
    count given for another kind (the bands are banded's, the buffers BLT's) and banded noise
    without its bands, naming `keys` (the kind's, the bands', the buffers' as the user spelled
    them). The one rule the command line and `strategy_for` use."""
    kind_key, bands_key, buffers_key = keys
    noise_class(kind, kind_key)
    for key, value, owner in ((bands_key, bands, "banded"), (buffers_key, buffers, "blt")):
        if value is not None and kind != owner:
            raise ConfigError(f"{key}={value} is only used with {kind_key}={owner} "
                              f"({kind_key}={kind}): drop it, or set {kind_key}={owner}.")
    if kind == "banded" and bands is None:
        raise ConfigError(f"{kind_key}=banded needs {bands_key}=B, the number of bands (an "
                          "example then takes part at most once every B steps), e.g. "
                          f"{bands_key}=4.")
    return kind


def check_compatible(strategy: NoiseStrategy, *, noise_schedule: bool, rate_schedule: bool,
                     clipping: str) -> None:
    """ConfigError when a correlated `strategy` meets what it cannot follow: a varying sigma
    (`noise_schedule`), a varying q (`rate_schedule`: the noise is scaled by 1 / (q N) before it
    is correlated) or adaptive clipping (its bound, hence the noise std, changes every step).
    Independent noise accepts all of them."""
    if isinstance(strategy, Independent):
        return
    problems = [what for what, bad in (
        ("a noise schedule (noise_schedule)", noise_schedule),
        ("a sample-rate schedule (sample_rate_schedule)", rate_schedule),
        ("adaptive clipping (privacy.clipping=adaptive)", clipping == "adaptive")) if bad]
    if problems:
        raise ConfigError(f"privacy.noise={strategy.name} correlates the noise of every step "
                          f"with a constant std, which {' and '.join(problems)} would change "
                          "from step to step. Use privacy.noise=independent with it, or drop it.")
