"""The accounting side of each batch-selection scheme, by name: the one registry the accounting
consults instead of comparing selection names.

A `SelectionAccounting` says how the steps of one scheme are charged: the neighbouring relation
its epsilon is stated for, whether amplification by subsampling applies, whether its steps go
through `CorrelatedNoiseAccountant` even with independent noise (cyclic groups), which
participation schema correlated noise is charged under, and which accountant charges it with
independent noise. `dptrain.accounting.events.AccountingEvent` reads these traits; the
selection strategies of `dptrain.privacy.selection` name their entry (`accounting_kind`).

    poisson         amplified, add/remove; the named accountant (rdp | prv | gdp) itself
    given           the caller's loader, charged as poisson (no proof: the engine warns)
    shuffle         no amplification, substitution (dptrain.accounting.shuffle)
    cyclic_poisson  amplified per group, add/remove (CorrelatedNoiseAccountant)
    balls_in_bins   random allocation, add/remove (dptrain.accounting.random_allocation)

How several runs' charges compose (a sweep releasing every job, dptrain.accounting.tuning):
poisson histories concatenate into one history of the named accountant (`pooled`); poisson and
balls_in_bins runs also compose as RDP curves added direction by direction (`rdp`); the others
state why they do not (`not_composed`).

A new scheme adds one entry with `register_selection_accounting`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dptrain.accounting.base import Accountant
from dptrain.accounting.history import History
from dptrain.accounting.matrix_factorization import (
    Participation,
    cyclic_participation,
    shuffle_participation,
)
from dptrain.accounting.random_allocation import (
    DIRECTION_ORDERS,
    RandomAllocationAccountant,
    history_rdp as random_allocation_rdp,
)
from dptrain.accounting.rdp import history_rdp as poisson_rdp
from dptrain.accounting.shuffle import ShuffleAccountant
from dptrain.errors import PrivacyError

# Neighbouring relations, in the words the ledger and the docs use.
ADD_REMOVE = "add/remove"
SUBSTITUTION = "substitution"


@dataclass(frozen=True)
class SelectionAccounting:
    """How the steps of one batch-selection scheme are charged.

    name: the scheme's accounting name (AccountingEvent.selection, the ledger's).
    relation: ADD_REMOVE or SUBSTITUTION, what two neighbouring datasets differ in.
    amplifies: amplification by (cyclic) Poisson subsampling applies to its steps.
    grouped: its steps follow `groups` cyclic groups (they may exceed 1; charged through
        CorrelatedNoiseAccountant even with independent noise).
    participation: the participation schema of a history's steps (for correlated noise),
        given the history and the groups; None when correlated noise is not accounted with it.
    accountant: the accountant charging its steps with independent noise, built from the
        configured accountant's name (the result carries it); None: that accountant itself.
    pooled: the histories of several runs charged this way (independent noise) are one history
        of the same mechanism: concatenated, charged by the named accountant (rdp | prv | gdp).
    rdp: rdp(history, orders, direction) -> the RDP curve [len(orders)] (nats) of a run's
        history in one direction (dptrain.accounting.rdp.REMOVE or ADD) of the add/remove pair,
        so that runs charged under different analyses compose by adding curves direction by
        direction; None: its runs are not composed with others (`not_composed` says why).
    rdp_orders: {direction: the orders `rdp` is computed at}; None: any order > 1.
    not_composed: why a set of runs with one charged this way has no composed cost.
    """

    name: str
    relation: str = ADD_REMOVE
    amplifies: bool = True
    grouped: bool = False
    participation: Callable[[History, int], Participation] | None = None
    accountant: Callable[[str], Accountant] | None = None
    pooled: bool = False
    rdp: Callable[[History, Sequence[float], str], np.ndarray] | None = None
    rdp_orders: dict[str, tuple[float, ...]] | None = field(default=None, compare=False)
    not_composed: str = ""

    @property
    def composes(self) -> bool:
        """Whether runs charged this way compose with others (a sweep's cost): `rdp` given."""
        return self.rdp is not None


_REGISTRY: dict[str, SelectionAccounting] = {}


def register_selection_accounting(entry: SelectionAccounting) -> SelectionAccounting:
    """Add `entry` under its name (a name registered twice is refused)."""
    if entry.name in _REGISTRY:
        raise PrivacyError(f"a selection's accounting named {entry.name!r} is already registered.")
    _REGISTRY[entry.name] = entry
    return entry


def selection_accounting(name: str) -> SelectionAccounting:
    """The registered accounting of the selection `name`; PrivacyError naming the known ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise PrivacyError(f"selection {name!r} is unknown to the accounting: use one of "
                           f"{sorted(_REGISTRY)}.") from None


def accounted_selections() -> tuple[str, ...]:
    """The names of every registered selection accounting."""
    return tuple(_REGISTRY)


def composable_selections() -> tuple[str, ...]:
    """The names of the registered selections whose runs compose (`SelectionAccounting.rdp`)."""
    return tuple(name for name, entry in _REGISTRY.items() if entry.composes)


def _poisson_rdp(history: History, orders: Sequence[float], direction: str) -> np.ndarray:
    return poisson_rdp(history, orders)   # the same curve bounds both directions


def _cyclic(history: History, groups: int) -> Participation:
    return cyclic_participation(history, groups)


def _shuffle(history: History, groups: int) -> Participation:
    return shuffle_participation(history)


register_selection_accounting(SelectionAccounting("poisson", participation=_cyclic, pooled=True,
                                                  rdp=_poisson_rdp))
register_selection_accounting(SelectionAccounting(
    "given", participation=_cyclic,
    not_composed="the caller's own loader is charged as Poisson sampling without a proof"))
register_selection_accounting(SelectionAccounting(
    "cyclic_poisson", grouped=True, participation=_cyclic,
    not_composed=("its cyclic groups are charged as one correlated-noise event over the whole "
                  "run (dptrain.accounting.events), which has no per-run curve to compose")))
register_selection_accounting(SelectionAccounting(
    "shuffle", relation=SUBSTITUTION, amplifies=False, participation=_shuffle,
    accountant=ShuffleAccountant,
    not_composed=("its epsilon is stated for substitution (replacing one example), not "
                  "add/remove, and charged by epochs without amplification: runs compose here "
                  "as add/remove RDP curves only")))
register_selection_accounting(SelectionAccounting(
    "balls_in_bins", amplifies=False, accountant=RandomAllocationAccountant,
    rdp=random_allocation_rdp, rdp_orders=DIRECTION_ORDERS))

__all__ = ["ADD_REMOVE", "SUBSTITUTION", "SelectionAccounting", "accounted_selections",
           "composable_selections", "register_selection_accounting", "selection_accounting"]
