"""What the strategy axes share (selection, unit): a frozen dataclass whose `kind` picks the
registered class, so that `Selection(q, kind="shuffle")` is a `Shuffle` and `Unit("user")` a
`UserUnit`, and `dataclasses.replace(..., kind=...)`, copy and pickle keep working."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


def registered_instance(cls: type, base: type, kind: Any, default_kind: str,
                        lookup: Callable[[Any], type], args: Sequence[Any],
                        kwargs: Mapping[str, Any]) -> Any:
    """A new, uninitialised object of the class registered for `kind` (`lookup(kind)`; None:
    `cls` itself, or `default_kind`'s class when `cls` is the axis's `base`), for `base.__new__`.

    When that class is not a subclass of `cls`, Python would not call its `__init__` after
    `__new__`: it is called here with `args` and `kwargs`.
    """
    if kind is None:
        target = cls if cls is not base else lookup(default_kind)
    else:
        target = lookup(kind)
    obj = object.__new__(target)
    if not issubclass(target, cls):
        obj.__init__(*args, **kwargs)
    return obj


__all__ = ["registered_instance"]
