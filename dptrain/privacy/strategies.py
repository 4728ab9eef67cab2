"""What the strategy axes share (selection, unit): a registry of classes by `kind`, and a frozen
dataclass whose `kind` picks the registered class, so that `Selection(q, kind="shuffle")` is a
`Shuffle` and `Unit("user")` a `UserUnit`, and `dataclasses.replace(..., kind=...)`, copy and
pickle keep working."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dptrain.errors import ConfigError, PrivacyError


class Registry:
    """The registered strategy classes of one axis, by `kind` (the plan's and the config's name).

    Args:
        what: the axis in the words of an error ("batch selection", "privacy unit").
        key: the config key that names a kind (in the error of an unknown one).
    """

    def __init__(self, what: str, key: str) -> None:
        self.what, self.key = what, key
        self.classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Register `cls` under its dataclass field `kind`'s default; PrivacyError for a kind
        already registered (a second class would silently change what a recorded kind means)."""
        kind = cls.__dataclass_fields__["kind"].default  # type: ignore[attr-defined]
        if kind in self.classes:
            raise PrivacyError(f"a {self.what} named {kind!r} is already registered.")
        self.classes[kind] = cls
        return cls

    def kinds(self) -> tuple[str, ...]:
        """The registered kinds, in registration order."""
        return tuple(self.classes)

    def lookup(self, kind: Any, key: str | None = None) -> type:
        """The class registered as `kind`; ConfigError naming `key` (default: the axis's) and
        the known kinds."""
        cls = self.classes.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ConfigError(f"{key or self.key}={kind!r} is not a known {self.what}: use one of "
                              f"{', '.join(self.kinds())}.")
        return cls


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


__all__ = ["Registry", "registered_instance"]
