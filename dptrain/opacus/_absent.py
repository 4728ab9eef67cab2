"""Opacus names that dptrain has no counterpart for: they import (so a script or module that
imports them still loads) and raise one clear error when used."""

from __future__ import annotations

from typing import Any, NoReturn

from dptrain.errors import ConfigError


def absent(opacus_name: str, instead: str) -> type:
    """A stand-in for Opacus's `opacus_name` (its dotted path): a class whose instantiation or
    call (and that of any subclass) raises ConfigError saying that dptrain.opacus has no
    counterpart and what to use `instead`."""

    def refuse(cls: type, *args: Any, **kwargs: Any) -> NoReturn:
        raise ConfigError(
            f"{opacus_name} has no counterpart in dptrain.opacus (it is importable only so that "
            f"code importing it loads): dptrain computes this part of DP-SGD its own way. "
            f"Use instead: {instead}. docs/migrating-from-opacus.md lists every such name.")

    name = opacus_name.rsplit(".", 1)[-1]
    return type(name, (), {"__new__": refuse, "__doc__": f"Not in dptrain: use {instead}.",
                           "__module__": "dptrain.opacus._absent"})
