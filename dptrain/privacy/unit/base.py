"""The privacy-unit strategy: what every privacy unit owns, and the registry of units.

A `Unit` is the frozen part of the privacy plan that says who epsilon protects (what two
neighbouring datasets differ in), and it *is* its strategy: `Unit(kind="user")` builds the
registered `UserUnit`, and every behaviour the engine, the ledger, resume and the command line
need is asked of it, never switched on its kind:

    population       population(data_loader, user_ids, loader_rate): N (what a batch counts)
                     and q; count(dataset) for the command line; samples_examples: N counts the
                     loader's examples (each example is its own unit)
    index stream     private_loader(selection, data_loader, user_ids, context): the selection's
                     loader, or a loader drawing units made of several examples
    clipping         clipper(clipper, params, data_loader, source): what is clipped to C (an
                     example's gradient, or a user's mean gradient)
    rules            check_selection(selection): the selections it can be sampled with;
                     check_data(user_ids, distributed): make_private's data for it;
                     data_arguments(dataset): make_private's arguments from a dataset
    resume           assignment_fingerprint(loader): what a resume must find unchanged beside
                     the data's records (which rows form each unit)
    ledger           privacy_unit(selection): the ledger's `mechanism.privacy_unit` words (the
                     neighbouring relation); ledger_entries(data_loader): its other entries

The plan records `kind` and `max_examples_per_user` (`to_dict`, unchanged since the plan's
version 1, so old ledgers read back to the same strategies). A new unit is one module (its
strategy class) and one `register_unit` line in dptrain/privacy/unit/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from torch import nn
from torch.utils.data import DataLoader

from dptrain.data.user_sampling import check_max_examples_per_user
from dptrain.privacy.clipping import Clipper
from dptrain.privacy.strategies import Registry, registered_instance

if TYPE_CHECKING:  # annotations only: the selection package does not import this one
    from dptrain.privacy.selection import LoaderContext, Selection

_UNITS = Registry("privacy unit", "privacy.unit")
#: (N, q) of a plain loader (the engine's `_loader_rate`: q = batch_size / N)
LoaderRate = Callable[[DataLoader], "tuple[int, float]"]


def register_unit(cls: type["Unit"]) -> type["Unit"]:
    """Register a privacy-unit class under its `kind` (the plan's and the config's name)."""
    return _UNITS.register(cls)


def unit_kinds() -> tuple[str, ...]:
    """The registered privacy-unit kinds, in registration order."""
    return _UNITS.kinds()


def unit_described(sentence: str) -> str:
    """The unit kind whose words (`protects`) start `sentence`, a ledger's
    mechanism.privacy_unit (how a ledger written before the plan was recorded names its unit);
    the default unit's kind when none does."""
    for kind in unit_kinds():
        if kind != Unit.kind and sentence.startswith(_UNITS.classes[kind].protects):
            return kind
    return Unit.kind


def unit_class(kind: Any, key: str = "privacy.unit") -> type["Unit"]:
    """The unit class registered as `kind`; ConfigError naming `key` and the known kinds."""
    return _UNITS.lookup(kind, key)


@dataclass(frozen=True)
class Unit:
    """Who epsilon protects: `kind` picks the registered strategy (see the module docstring);
    `max_examples_per_user` caps what one sampled user contributes to a batch (user level only;
    None: all of its examples). The user of each example is data, given to make_private
    (`user_ids`), not part of the plan."""

    kind: str = "example"
    max_examples_per_user: int | None = None

    #: N counts the loader's examples: each example is its own unit (the selection draws them)
    samples_examples: ClassVar[bool] = True
    #: what one unit is, in the words of a report ("one example"; the ledger's privacy_unit
    #: sentence starts with them)
    protects: ClassVar[str] = "one example"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Unit":
        """The registered strategy of `kind` (given or its class's default): Unit("user") is a
        UserUnit; dataclasses.replace(..., kind=...) changes the class."""
        kind = kwargs.get("kind", args[0] if args else None)
        return registered_instance(cls, Unit, kind, Unit.kind, unit_class, args, kwargs)

    def __post_init__(self) -> None:
        unit_class(self.kind)
        object.__setattr__(self, "max_examples_per_user", check_max_examples_per_user(
            self.max_examples_per_user, "privacy.max_examples_per_user"))

    # -- the population ------------------------------------------------------------------------
    def population(self, data_loader: DataLoader, user_ids: Any,
                   loader_rate: LoaderRate) -> tuple[int, float]:
        """(N, q): N the units of `data_loader`'s dataset, q the expected fraction of them in a
        batch (default: the loader's examples, `loader_rate(data_loader)`)."""
        return loader_rate(data_loader)

    def count(self, dataset: Any) -> tuple[int, str]:
        """(N, what N counts, in words) of a training set (the command line's sizing)."""
        return len(dataset), "training examples"

    # -- rules -----------------------------------------------------------------------------------
    def check_selection(self, selection: "Selection") -> None:
        """ConfigError when `selection` cannot sample this unit (default: every selection can)."""

    def check_data(self, user_ids: Any, distributed: bool) -> None:
        """ConfigError when make_private's data does not fit this unit (`user_ids`: one user id
        per example or None; `distributed`: a DDP or FSDP model)."""

    def data_arguments(self, dataset: Any) -> dict[str, Any]:
        """make_private's keyword arguments that come from the training set (default: none)."""
        return {}

    # -- the index stream and clipping -----------------------------------------------------------
    def private_loader(self, selection: "Selection", data_loader: DataLoader, user_ids: Any,
                       context: "LoaderContext") -> Any:
        """The loader drawing the batches (default: the selection's, over the examples)."""
        return selection.private_loader(data_loader, context)

    def clipper(self, clipper: Clipper, params: Sequence[nn.Parameter], data_loader: Any,
                source: Any) -> Clipper:
        """The clipper bounding one unit's contribution by C (default: `clipper`, per example;
        `data_loader` is `private_loader`'s, `source` the wrapped model)."""
        return clipper

    # -- resume and the ledger ---------------------------------------------------------------------
    def assignment_fingerprint(self, data_loader: Any) -> str | None:
        """What forms each unit beside the data's records, hashed for resume (None: nothing,
        each example is its own unit)."""
        return None

    def privacy_unit(self, selection: "Selection") -> str:
        """The ledger's `mechanism.privacy_unit`: who epsilon protects, under the neighbouring
        relation `selection` is accounted for."""
        raise NotImplementedError

    def ledger_entries(self, data_loader: Any) -> dict[str, Any]:
        """Other entries of the ledger's mechanism (default: none); `data_loader` is the private
        loader."""
        return {}


__all__ = ["LoaderRate", "Unit", "register_unit", "unit_class", "unit_kinds"]
