"""The DP-SGD mechanism (issue 3): clipping, noise, schedules, DPOptimizer, PrivacyEngine.

`PrivacyEngine` and `make_private` are imported lazily (engine.py imports dptrain.data, which
itself uses dptrain.privacy.noise).
"""

from importlib import import_module
from typing import Any

from dptrain.privacy.clipping import (
    AdaptiveClipper,
    Clipper,
    FlatClipper,
    PerLayerClipper,
    make_clipper,
)
from dptrain.privacy.noise import gaussian_noise
from dptrain.privacy.optimizer import DPOptimizer
from dptrain.privacy.schedules import (
    ConstantSchedule,
    ExponentialSchedule,
    LambdaSchedule,
    Schedule,
    StepSchedule,
)

_LAZY = ("PrivacyEngine", "PrivateTraining", "make_private")

__all__ = [
    "AdaptiveClipper",
    "Clipper",
    "ConstantSchedule",
    "DPOptimizer",
    "ExponentialSchedule",
    "FlatClipper",
    "LambdaSchedule",
    "PerLayerClipper",
    "PrivacyEngine",
    "PrivateTraining",
    "Schedule",
    "StepSchedule",
    "gaussian_noise",
    "make_clipper",
    "make_private",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module("dptrain.privacy.engine"), name)
    raise AttributeError(f"module 'dptrain.privacy' has no attribute {name!r}")
