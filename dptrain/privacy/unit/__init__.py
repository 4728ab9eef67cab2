"""Privacy-unit strategies, one module each, and their registry (see base.py for what a unit
owns). The registration lines below are the only list of units:

    example   one training example (the default): the selection's loader, each example clipped
    user      all the examples of one user: Poisson over users, each user's mean gradient clipped
"""

from __future__ import annotations

from dptrain.privacy.unit.base import (LoaderRate, Unit, register_unit, unit_class,
                                       unit_described, unit_kinds)
from dptrain.privacy.unit.example import (
    PRIVACY_UNIT,
    SHUFFLE_PRIVACY_UNIT,
    ZERO_OUT_PRIVACY_UNIT,
    ExampleUnit,
)
from dptrain.privacy.unit.user import UserUnit

register_unit(ExampleUnit)
register_unit(UserUnit)

__all__ = ["ExampleUnit", "LoaderRate", "PRIVACY_UNIT", "SHUFFLE_PRIVACY_UNIT", "Unit",
           "UserUnit", "ZERO_OUT_PRIVACY_UNIT", "register_unit", "unit_class", "unit_described",
           "unit_kinds"]
