"""Accountants by name: "rdp", "prv", "gdp" (the names a user types in configs and on the CLI),
for the event a run's steps are charged as (dptrain.accounting.events)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from dptrain.accounting.base import Accountant
from dptrain.accounting.events import AccountingEvent, CorrelatedNoiseAccountant, as_event
from dptrain.accounting.history import normalize_history
from dptrain.accounting.gdp import GaussianAccountant
from dptrain.accounting.prv import PRVAccountant
from dptrain.accounting.rdp import RDPAccountant
from dptrain.checks import check_delta
from dptrain.errors import PrivacyError

ACCOUNTANTS: dict[str, type[Accountant]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "gdp": GaussianAccountant,
}


def accountant_class(name: str, argument: str = "accountant") -> type[Accountant]:
    """The accountant class registered as `name`; PrivacyError naming `argument` otherwise."""
    key = name.lower() if isinstance(name, str) else name
    if key not in ACCOUNTANTS:
        raise PrivacyError(
            f"{argument}={name!r} is not a known accountant: use one of {sorted(ACCOUNTANTS)} "
            "('prv' tight numerical, 'rdp' Renyi DP, 'gdp' CLT approximation)."
        )
    return ACCOUNTANTS[key]


def get_accountant(name: str = "prv", sampling: str | AccountingEvent = "poisson",
                   **kwargs: Any) -> Accountant:
    """A new, empty accountant selected by name ("rdp" | "prv" | "gdp") for steps charged as
    `sampling`: a selection's accounting name ("poisson": amplified; "shuffle", "balls_in_bins":
    the selection's own accountant, carrying `name`: dptrain.accounting.selections), or an
    `AccountingEvent` (cyclic Poisson sampling, correlated noise: `CorrelatedNoiseAccountant`
    carrying `name`; a plain event gives the same accountants as its selection's name)."""
    cls = accountant_class(name)
    event = as_event(sampling)
    if not event.plain:
        return CorrelatedNoiseAccountant(cls, event)
    own = event.traits.accountant  # the selection's own accountant (shuffle, random allocation)
    return cls(**kwargs) if own is None else own(cls.name)


def compute_epsilon(history: Iterable[Sequence[Any] | Mapping[str, Any]], delta: float,
                    accountant: str = "rdp", sampling: str | AccountingEvent = "poisson") -> float:
    """Epsilon (nats) of a stored history of (noise_multiplier, sample_rate, steps) runs at delta.

    Stateless: the ledger verifier recomputes claimed epsilons with it. math.inf when a step used
    noise_multiplier == 0 with sample_rate > 0; 0.0 for an empty history. `sampling`: how the
    steps are charged ("poisson", "shuffle": dptrain.accounting.shuffle, or an AccountingEvent).
    """
    acc = get_accountant(accountant, sampling)
    acc.load_state_dict({"name": acc.name, "history": normalize_history(history)})
    return acc.get_epsilon(check_delta(delta))
