"""What a run's steps are charged as: its batch selection and its noise strategy's column.

An `AccountingEvent` is the part of a run's plan that decides which privacy analysis applies:

==================  =====================  ===================================================
selection           noise column c         event (dptrain.accounting.matrix_factorization)
==================  =====================  ===================================================
poisson / given     independent (1, 0...)  Poisson DP-SGD (the accountant itself)
shuffle             independent            shuffled batches (dptrain.accounting.shuffle)
cyclic_poisson (b)  <= b bands             amplified banded MF: DP-SGD rounds, add/remove
poisson (b = 1)     <= 1 band              the same (b = 1)
poisson / cyclic    more bands than b      unamplified, add/remove, participations b apart
shuffle             correlated             unamplified, substitution, one per epoch
==================  =====================  ===================================================

The add/remove relation of cyclic Poisson sampling rests on how its groups are drawn: each
example's group uniform and independent of the others' (dptrain.data.cyclic_sampling.partition),
so that adding one example leaves every other example's group, and so the charge of its own
participations, as it was. An equal split would support only zero-out or replace-one.

The engine's accountant, the ledger's recomputation (`dptrain-ledger`) and the planner's
calibration all get theirs from `dptrain.accounting.get_accountant(name, event)`, so the three
never disagree. The event is built from a plan by `dptrain.privacy.plan.PrivacyPlan.accounting`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dptrain.accounting.base import Accountant
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.history import History, spending_runs
from dptrain.accounting.matrix_factorization import (
    Participation,
    ToeplitzStrategy,
    amplified_history,
    bands,
    check_column,
    column_norm,
    sensitivity,
    unamplified_mu,
)
from dptrain.accounting.selections import (
    ADD_REMOVE,
    SUBSTITUTION,
    SelectionAccounting,
    accounted_selections,
    selection_accounting,
)
from dptrain.errors import PrivacyError

# the ledger's name of the participation schema of amplified rounds (cyclic groups)
CYCLIC_PARTICIPATION = "cyclic_poisson"
#: the selections' accounting names (dptrain.accounting.selections: the registry)
SELECTIONS = accounted_selections()


def _strategy_key(strategy: Any) -> str:
    """A strategy's identity for equality and hashing: its recorded dict as sorted JSON."""
    if strategy is None:
        return ""
    to_dict = getattr(strategy, "to_dict", None)
    return json.dumps(to_dict(), sort_keys=True) if callable(to_dict) else repr(strategy)


@dataclass(frozen=True)
class AccountingEvent:
    """How steps are charged: `selection` (poisson | shuffle | cyclic_poisson | given), the
    number of sampling `groups` (cyclic Poisson; 1 otherwise) and the noise `strategy` (any
    object with `toeplitz_column(num_steps)`; None: independent noise, c = (1, 0, ...)).

    Equal (and hashed) by selection, groups and the strategy's `to_dict()`, so that it can key
    caches of epsilons."""

    selection: str = "poisson"
    groups: int = 1
    strategy: ToeplitzStrategy | None = field(default=None, compare=False, hash=False)
    strategy_key: str = field(default="", init=False)

    def __post_init__(self) -> None:
        traits = selection_accounting(self.selection)  # PrivacyError naming the known ones
        if isinstance(self.groups, bool) or int(self.groups) != self.groups or self.groups < 1:
            raise PrivacyError(f"groups={self.groups!r} must be an integer >= 1.")
        if not traits.grouped and self.groups != 1:
            raise PrivacyError(f"groups={self.groups} needs a grouped selection (cyclic_poisson), "
                               f"not {self.selection}.")
        object.__setattr__(self, "strategy_key", _strategy_key(self.strategy))
        if traits.participation is None and self.correlated:
            raise PrivacyError(f"correlated noise ({self.strategy_key}) is not accounted with "
                               f"selection {self.selection}: use independent noise with it.")

    @property
    def traits(self) -> SelectionAccounting:
        """How its selection's steps are charged (dptrain.accounting.selections)."""
        return selection_accounting(self.selection)

    # -- the column ------------------------------------------------------------------------
    def column(self, num_steps: int) -> np.ndarray:
        """c of the strategy for `num_steps` steps, float64 [num_steps]; e_0 when independent."""
        if self.strategy is None:
            return check_column([1.0], num_steps)
        return check_column(self.strategy.toeplitz_column(int(num_steps)), num_steps)

    @property
    def correlated(self) -> bool:
        """Whether the noise differs from independent noise, c = (1, 0, ...)."""
        if self.strategy is None:
            return False
        c = self.column(64)
        return not (c[0] == 1.0 and bands(c) == 1)

    @property
    def plain(self) -> bool:
        """Independent noise with Poisson, shuffled or given batches: today's DP-SGD accounting."""
        return not self.correlated and not self.traits.grouped

    def amplified(self, num_steps: int) -> bool:
        """Whether amplification by (cyclic) Poisson sampling applies: a Poisson selection and a
        column of at most `groups` bands."""
        return (self.traits.amplifies
                and bands(self.column(max(1, num_steps))) <= self.groups)

    @property
    def relation(self) -> str:
        """The neighbouring relation epsilon is stated for (cyclic Poisson: add/remove, its
        groups being drawn independently per example; see the module docstring)."""
        return self.traits.relation

    def participation(self, history: History) -> Participation:
        """The participation schema of a history's steps under this selection."""
        participation = self.traits.participation
        if participation is None:
            raise PrivacyError(f"selection {self.selection} has no participation schema for "
                               "correlated noise.")
        return participation(history, self.groups)

    def describe(self, history: History) -> dict[str, Any]:
        """What the ledger records of the charge of `history`: the relation, whether amplified,
        the sensitivity (units of clip) and the participation schema."""
        steps = sum(n for _, _, n in history)
        amplified = self.amplified(steps)
        out: dict[str, Any] = {"selection": self.selection, "groups": self.groups,
                               "relation": self.relation, "amplified": amplified}
        if not history:
            return out
        c = self.column(steps)
        if amplified:
            out["sensitivity"] = column_norm(c)
            out["participation"] = {"kind": CYCLIC_PARTICIPATION, "groups": self.groups,
                                    "rounds": math.ceil(steps / self.groups)}
        else:
            schema = self.participation(history)
            out["sensitivity"] = sensitivity(c, schema)
            out["participation"] = schema.to_dict()
        return out


class CorrelatedNoiseAccountant(Accountant):
    """The accountant of an `AccountingEvent` that is not plain DP-SGD (cyclic Poisson sampling
    or correlated noise): it records steps like every accountant and charges them as the event
    says (dptrain.accounting.matrix_factorization), the amplified rounds with `base`'s method.

    It carries `base`'s name (prv | rdp | gdp), so the ledger's claims under that name agree."""

    def __init__(self, base: type[Accountant], event: AccountingEvent) -> None:
        super().__init__()
        self.base = base
        self.name = base.name
        self.event = event
        self.approximate = base.approximate
        self.guarantee = base.guarantee

    @property
    def charges(self) -> dict[str, Any]:
        """Its event: selection, groups and the noise strategy (`AccountingEvent.strategy_key`)."""
        return {"selection": self.event.selection, "groups": self.event.groups,
                "strategy": self.event.strategy_key}

    def _charged_runs(self) -> History:
        # every step keeps its position (cyclic groups, epochs), q = 0 steps included
        return list(self._history) if spending_runs(self._history) else []

    def _amplified(self, runs: History) -> Accountant:
        steps = sum(n for _, _, n in runs)
        rounds = amplified_history(runs, self.event.groups, self.event.column(steps))
        return self.base.from_history(rounds)

    def _mu(self, runs: History) -> float:
        steps = sum(n for _, _, n in runs)
        factor = 2.0 if self.event.relation == SUBSTITUTION else 1.0
        return unamplified_mu(runs, self.event.column(steps), self.event.participation(runs),
                              factor)

    def _epsilon(self, runs: History, delta: float) -> float:
        if self.event.amplified(sum(n for _, _, n in runs)):
            return self._amplified(runs).get_epsilon(delta)
        return gdp_epsilon(self._mu(runs), delta)

    def _delta(self, runs: History, epsilon: float) -> float:
        if self.event.amplified(sum(n for _, _, n in runs)):
            return self._amplified(runs).get_delta(epsilon)
        return gdp_delta(self._mu(runs), epsilon)


def as_event(sampling: "str | AccountingEvent") -> AccountingEvent:
    """An event from a selection name ("poisson" | "shuffle" | ...) or an event as is."""
    return sampling if isinstance(sampling, AccountingEvent) else AccountingEvent(str(sampling))


__all__ = ["ADD_REMOVE", "SELECTIONS", "SUBSTITUTION", "AccountingEvent",
           "CorrelatedNoiseAccountant", "as_event"]
