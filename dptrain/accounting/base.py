"""The accountant interface shared by every accounting method.

An accountant records a *history*: runs of identical DP-SGD steps, each a tuple
``(noise_multiplier, sample_rate, steps)``. The noise multiplier sigma is the ratio of the Gaussian
noise standard deviation to the clipping norm (unitless), the sample rate q is the Poisson sampling
probability of each example (unitless, in [0, 1]) and steps is a count. Consecutive identical steps
are merged, so a million steps with a constant sigma and q cost one tuple.

Subclasses implement only the privacy computation on a cleaned history (``_epsilon`` and optionally
``_delta``); the infinite-epsilon rule for sigma == 0 and state handling live here once, the
history operations in dptrain.accounting.history and the argument checks in dptrain.checks (a
recorded step may have q = 0: it sampled nobody and spends nothing).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping, Sequence

from dptrain.accounting.history import (  # noqa: F401  (coarsen_history, Run: re-exported)
    History,
    Run,
    coarsen_history,
    has_infinite_loss,
    normalize_history,
    spending_runs,
)
from dptrain.checks import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from dptrain.errors import PrivacyError

_STATE_VERSION = 1


def _describe(charges: Any) -> str:
    """`Accountant.charges` in words, e.g. "selection=shuffle"."""
    if not isinstance(charges, Mapping):
        return repr(charges)
    return ", ".join(f"{key}={value}" for key, value in sorted(charges.items())) or "?"


def warn_infinite(name: str) -> None:
    """Warn that a history with sigma == 0 has an infinite epsilon."""
    warnings.warn(
        f"{name} accountant: a step with noise_multiplier=0 and sample_rate>0 was taken, so no "
        "finite (epsilon, delta) guarantee holds: epsilon is infinite.",
        UserWarning,
        stacklevel=3,
    )


class Accountant(ABC):
    """Base class: a history of DP-SGD steps and its privacy cost.

    Subclasses set ``name``, ``approximate`` (True when the result is not a guaranteed upper
    bound), ``guarantee`` (what the epsilon is, in the words every report uses: the ledger's
    summary, `dptrain-privacy`, the docs) and implement ``_epsilon(history, delta)`` for a
    non-empty history of runs with sigma > 0 and q > 0.
    """

    name: str = ""
    approximate: bool = False
    guarantee: str = "upper bound"
    #: the batch selection its history is accounted for (`get_accountant`'s `sampling`)
    sampling: str = "poisson"

    def __init__(self) -> None:
        self._history: History = []

    # ---- history ---------------------------------------------------------------------------
    @property
    def history(self) -> History:
        """Runs of identical steps: list of (noise_multiplier, sample_rate, steps)."""
        return list(self._history)

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record `steps` DP-SGD steps with noise multiplier sigma and sample rate q.

        sigma == 0 (with q > 0) is recorded and makes epsilon infinite (with a warning); q == 0
        steps are recorded but spend nothing; steps == 0 records nothing.
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate, allow_zero=True)
        n = check_steps(steps)
        if sigma == 0.0 and q > 0.0 and n > 0:
            warn_infinite(self.name)
        if n == 0:
            return
        last = self._history[-1] if self._history else None
        if last is not None and last[0] == sigma and last[1] == q:
            self._history[-1] = (sigma, q, last[2] + n)   # O(1): merge with the last run
        else:
            self._history.append((sigma, q, n))

    def step_charge(self, charge: Any) -> None:
        """Record one step as charged (a `dptrain.privacy.charge.Charge`: its sigma and q)."""
        self.step(noise_multiplier=charge.noise_multiplier, sample_rate=charge.sample_rate)

    @classmethod
    def from_charges(cls, charges: Iterable[Any]) -> "Accountant":
        """A new accountant holding the steps of `charges` (Charges, in order): the accountant a
        run's steps built, rebuilt from what they charged."""
        return cls.from_history((c.noise_multiplier, c.sample_rate, 1) for c in charges)

    @classmethod
    def from_history(cls, history: Iterable[Sequence[Any] | Mapping[str, Any]]) -> "Accountant":
        """A new accountant holding a (validated) copy of `history`."""
        acc = cls()
        acc._history = normalize_history(history)
        return acc

    # ---- privacy ---------------------------------------------------------------------------
    def get_epsilon(self, delta: float) -> float:
        """Epsilon (natural-log units) of the whole history at `delta`; math.inf if sigma == 0."""
        d = check_delta(delta)
        runs = self._charged_runs()
        if not runs:
            return 0.0
        if has_infinite_loss(runs):
            warn_infinite(self.name)
            return math.inf
        return float(self._epsilon(runs, d))

    def get_delta(self, epsilon: float) -> float:
        """Smallest delta this method certifies at `epsilon`; 1.0 if sigma == 0 was stepped."""
        e = check_epsilon(epsilon)
        runs = self._charged_runs()
        if not runs:
            return 0.0
        if has_infinite_loss(runs):
            warn_infinite(self.name)
            return 1.0
        return float(min(1.0, max(0.0, self._delta(runs, e))))

    def _charged_runs(self) -> History:
        """The runs `_epsilon` and `_delta` charge: those that spend privacy (q > 0); [] when
        none does."""
        return spending_runs(self._history)

    @abstractmethod
    def _epsilon(self, runs: History, delta: float) -> float:
        """Epsilon of a non-empty history of runs with sigma > 0, q > 0, steps > 0."""

    @abstractmethod
    def _delta(self, runs: History, epsilon: float) -> float:
        """Delta of a non-empty history of runs with sigma > 0, q > 0, steps > 0."""

    # ---- state -----------------------------------------------------------------------------
    @property
    def charges(self) -> dict[str, Any]:
        """How its history is charged, as `state_dict` records it: {"selection"} (poisson |
        shuffle; CorrelatedNoiseAccountant adds its groups and noise strategy)."""
        return {"selection": self.sampling}

    def state_dict(self) -> dict[str, Any]:
        """A JSON/torch-serialisable snapshot: {"name", "version", "history", "charges"}."""
        return {
            "name": self.name,
            "version": _STATE_VERSION,
            "history": [[s, q, n] for s, q, n in self._history],
            "charges": self.charges,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the history saved by `state_dict`: the accountant name and, when the state
        records it (states saved before it was recorded do not), what the history was charged
        as (`charges`) must match."""
        name = state_dict.get("name", self.name)
        if name != self.name:
            raise PrivacyError(
                f"state_dict of a {name!r} accountant cannot be loaded into a {self.name!r} "
                "accountant: build the accountant with get_accountant(state_dict['name'])."
            )
        charges = state_dict.get("charges", self.charges)
        if not isinstance(charges, Mapping) or dict(charges) != self.charges:
            raise PrivacyError(
                f"state_dict holds a history charged as {_describe(charges)}, and this "
                f"{self.name!r} accountant charges its steps as {_describe(self.charges)}: loaded "
                "here, the saved steps would be charged under another mechanism's accounting "
                "(shuffled batches without amplification, or Poisson batches with it), and the "
                "epsilon would not be that of the steps taken. Load it into an accountant built "
                "for the same sampling (get_accountant(name, sampling), or make_private with the "
                "same sampling before loading the engine's state).")
        if "history" not in state_dict:
            raise PrivacyError("state_dict lacks 'history': pass the output of Accountant.state_dict().")
        self._history = normalize_history(state_dict["history"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self)}, runs={len(self._history)})"
