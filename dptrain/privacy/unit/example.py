"""Example-level privacy (privacy.unit=example, the default): two neighbouring datasets differ in
one training example. Each example is its own unit: the selection draws examples, each example's
gradient is clipped, and nothing beside the data's records forms a unit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptrain.errors import ConfigError
from dptrain.privacy.unit.base import Unit

if TYPE_CHECKING:
    from dptrain.privacy.selection import Selection

# What epsilon protects, by the relation the selection is accounted for (the ledger's
# mechanism.privacy_unit). DP-SGD with Poisson sampling is accounted for add/remove adjacency.
PRIVACY_UNIT = "one training example (add/remove: datasets differing by one example)"
# ... with shuffled batches (dptrain.accounting.shuffle).
SHUFFLE_PRIVACY_UNIT = ("one training example (substitution: datasets of the same size differing "
                        "in one example; no amplification by subsampling)")
# ... of a cyclic Poisson run resumed from a ledger written when the groups were an equal split
# (dptrain.train.ledger.record.carry_partition).
ZERO_OUT_PRIVACY_UNIT = ("one training example (zero-out: datasets of the same size, one "
                         "example's contribution replaced by nothing; not add/remove, see "
                         "mechanism.sampling_partition)")


@dataclass(frozen=True)
class ExampleUnit(Unit):
    """One training example (`max_examples_per_user` must stay None)."""

    kind: str = "example"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_examples_per_user is not None:
            raise ConfigError("privacy.max_examples_per_user is only used with privacy.unit=user: "
                              "set privacy.unit=user, or drop it.")

    def check_data(self, user_ids: Any, distributed: bool) -> None:
        """User ids given at example level would be silently ignored: refused."""
        if user_ids is not None:
            raise ConfigError("user_ids / max_examples_per_user (dataset.user_column, "
                              "privacy.max_examples_per_user) are only used with "
                              "privacy_unit='user' (privacy.unit=user): set it, or drop them.")

    def privacy_unit(self, selection: "Selection") -> str:
        return SHUFFLE_PRIVACY_UNIT if selection.shuffled else PRIVACY_UNIT


__all__ = ["ExampleUnit", "PRIVACY_UNIT", "SHUFFLE_PRIVACY_UNIT", "ZERO_OUT_PRIVACY_UNIT"]
