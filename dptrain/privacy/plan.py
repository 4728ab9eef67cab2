"""The privacy plan: one frozen, validated description of a run's mechanism.

A run's privacy is decided by its plan: who is protected (`Unit`), how batches are selected
(`Selection`: Poisson or shuffle, with the sample rate q), how contributions are bounded
(`Clipping`), what noise is added (`Noise`), how it is charged (`accountant`, `delta`) and where
the random draws come from (`randomness`). The CLI builds one from its typed config, the Python
API from `make_private`'s keyword arguments; the engine builds the mechanism from it, the ledger
records `to_dict()` and a resume compares `from_dict()` of the recorded one.

Settings that change only speed or memory (`PerformanceSettings`: grad-sample mode, physical
batch size, precision) are kept apart: two runs differing only there spend the same privacy.

    plan = PrivacyPlan(selection=Selection(sample_rate=0.01), clipping=Clipping(max_grad_norm=1.0),
                       noise=Noise(multiplier=1.1), accountant="prv", delta=1e-5)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dptrain.accounting.calibration import get_noise_multiplier
from dptrain.accounting.events import AccountingEvent
from dptrain.accounting.history import History, merge_history, steps_per_epoch
from dptrain.accounting.registry import accountant_class
from dptrain.checks import (
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    check_sample_rate,
    default_delta,
    one_of,
)
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.clipping import CLIPPING_MODES
from dptrain.privacy.noise import Independent, NoiseStrategy, check_compatible, strategy_from_dict
from dptrain.privacy.schedules import Schedule, as_schedule
from dptrain.privacy.selection import (  # noqa: F401  (Selection, default_selection: re-exported)
    Selection,
    default_selection,
    noise_bands as strategy_bands,
    selection_class,
    selection_kinds,
)
from dptrain.privacy.unit import Unit, unit_kinds  # noqa: F401  (Unit: re-exported)

# Who epsilon protects (UNITS): the registered units of dptrain.privacy.unit (one module each:
# one training example, or all the examples of one user).
UNITS = unit_kinds()
# How batches are selected: the registered strategies of dptrain.privacy.selection (one module
# each); the command line builds those it may (COMMAND_SELECTIONS), make_private all of them.
SELECTIONS = selection_kinds()
COMMAND_SELECTIONS = selection_kinds(command=True)   # privacy.sampling
GIVEN_SELECTIONS = tuple(k for k in SELECTIONS if k not in COMMAND_SELECTIONS)  # the caller's loader
RANDOMNESS = ("os_entropy", "secure", "reproducible")
GRAD_SAMPLE_MODES = ("hooks", "ghost")
PRECISIONS = ("fp32", "bf16")
PLAN_VERSION = 1


@dataclass(frozen=True)
class Clipping:
    """How each unit's contribution is bounded: flat | per_layer | adaptive, and C (a float, or
    one bound per parameter for per_layer); adaptive clipping's own parameters."""

    max_grad_norm: float | tuple[float, ...] = 1.0
    kind: str = "flat"
    target_unclipped_quantile: float = 0.5
    clipbound_learning_rate: float = 0.2
    count_noise_std: float | None = None

    def __post_init__(self) -> None:
        one_of(*CLIPPING_MODES).check(self.kind, "privacy.clipping")
        norm = check_max_grad_norm(self.max_grad_norm, "max_grad_norm",
                                   per_layer=self.kind == "per_layer")
        object.__setattr__(self, "max_grad_norm", tuple(norm) if isinstance(norm, list) else norm)


@dataclass(frozen=True)
class Noise:
    """The Gaussian noise: `multiplier` sigma (std in units of C), or None until calibrated to
    `target_epsilon`; with a given sigma, `target_epsilon` is a budget cap (None: no cap).
    `schedule` varies sigma by step (a given sigma only); `calibrated` says sigma was computed.
    `strategy` correlates the noise across steps (dptrain.privacy.noise: Independent, the
    default, is DP-SGD; Banded, Blt; a recorded dict is read back with its parameters)."""

    multiplier: float | None = None
    target_epsilon: float | None = None
    schedule: Mapping[str, Any] | None = None
    calibrated: bool = False
    strategy: NoiseStrategy = field(default_factory=Independent)

    def __post_init__(self) -> None:
        if self.multiplier is None and self.target_epsilon is None:
            raise PrivacyError("the plan needs a noise multiplier or a target epsilon: pass "
                               "noise_multiplier=1.0 or target_epsilon=3.0 (privacy=sigma or "
                               "privacy=epsilon on the command line).")
        object.__setattr__(self, "strategy", strategy_from_dict(self.strategy))
        if self.multiplier is not None:
            object.__setattr__(self, "multiplier", check_noise_multiplier(self.multiplier))
        if self.target_epsilon is not None:
            object.__setattr__(self, "target_epsilon",
                               check_epsilon(self.target_epsilon, "target_epsilon", target=True))
        if self.schedule is not None and (self.multiplier is None or self.calibrated):
            raise ConfigError("a noise schedule needs a given noise multiplier (privacy=sigma): "
                              "calibrating sigma to a target epsilon assumes a constant sigma.")


@dataclass(frozen=True)
class PerformanceSettings:
    """How the mechanism is computed, never what it is: per-sample gradient mode (hooks |
    ghost), the physical batch size (None: the whole logical batch) and the precision."""

    grad_sample_mode: str = "hooks"
    max_physical_batch_size: int | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        one_of(*GRAD_SAMPLE_MODES).check(self.grad_sample_mode, "grad_sample_mode")
        one_of(*PRECISIONS).check(self.precision, "precision")


@dataclass(frozen=True)
class PrivacyPlan:
    """The whole mechanism of a private run, validated once (see the module docstring).

    `delta` None means the default 1/(10 N) rounded down (`with_dataset` fills it in).
    """

    selection: Selection
    clipping: Clipping
    noise: Noise
    accountant: str = "prv"
    delta: float | None = None
    randomness: str = "os_entropy"
    unit: Unit = field(default_factory=Unit)

    def __post_init__(self) -> None:
        accountant_class(self.accountant)   # PrivacyError naming the accountant
        one_of(*RANDOMNESS).check(self.randomness, "randomness")
        if self.delta is not None:
            object.__setattr__(self, "delta", check_delta(self.delta, "target_delta"))
        check_compatible(self.noise.strategy, noise_schedule=self.noise.schedule is not None,
                         rate_schedule=self.selection.schedule is not None,
                         clipping=self.clipping.kind)
        self.unit.check_selection(self.selection)   # the unit's sampling (users: Poisson)
        self.selection.check_plan(self)   # clipping and noise beside the selection

    # -- derived values ------------------------------------------------------------------------
    @property
    def secure(self) -> bool:
        """Every random draw from the OS CSPRNG."""
        return self.randomness == "secure"

    @property
    def reproducible(self) -> bool:
        """Noise and sampling seeded from a known seed (an opt-in: no guarantee if it is known)."""
        return self.randomness == "reproducible"

    @property
    def accounting(self) -> AccountingEvent:
        """What its steps are charged as (dptrain.accounting.events): the selection, its groups
        and the noise strategy; the engine's accountant, the ledger's recomputation and the
        planner's calibration all take it to `get_accountant`."""
        return dataclasses.replace(self.selection.accounting, strategy=noise_strategy(self.noise))

    def expected_batch_size(self, num_examples: int) -> float:
        """q N, the public denominator of the averaged noisy gradient (examples)."""
        return self.selection.sample_rate * num_examples

    # -- building a resolved plan --------------------------------------------------------------
    def with_dataset(self, num_examples: int) -> PrivacyPlan:
        """The plan with its delta filled in for N = `num_examples` (`default_delta`)."""
        if self.delta is not None:
            return self
        return dataclasses.replace(self, delta=default_delta(num_examples))

    def with_noise_multiplier(self, sigma: float) -> PrivacyPlan:
        """The plan with sigma calibrated to its target epsilon."""
        return dataclasses.replace(self, noise=dataclasses.replace(
            self.noise, multiplier=sigma, calibrated=True))

    # -- the ledger's form ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (tuples as lists), read back by `from_dict`."""
        out = dataclasses.asdict(self)
        out["version"] = PLAN_VERSION
        norm = self.clipping.max_grad_norm
        out["clipping"]["max_grad_norm"] = list(norm) if isinstance(norm, tuple) else norm
        for part in ("selection", "noise"):
            schedule = out[part]["schedule"]
            out[part]["schedule"] = None if schedule is None else dict(schedule)
        out["noise"]["strategy"] = self.noise.strategy.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyPlan:
        """The plan `to_dict` wrote; ConfigError naming the part that cannot be read."""
        try:
            clipping = dict(data["clipping"])
            if isinstance(clipping.get("max_grad_norm"), list):
                clipping["max_grad_norm"] = tuple(clipping["max_grad_norm"])
            return cls(selection=Selection(**data["selection"]), clipping=Clipping(**clipping),
                       noise=Noise(**data["noise"]), accountant=data["accountant"],
                       delta=data["delta"], randomness=data["randomness"],
                       unit=Unit(**data.get("unit", {})))
        except (KeyError, TypeError) as error:
            raise ConfigError(f"a recorded privacy plan cannot be read ({type(error).__name__}: "
                              f"{error}): it was written by another dptrain version or edited "
                              "by hand.") from error

    def differences(self, other: PrivacyPlan) -> list[str]:
        """'key: mine != theirs' for every leaf where two plans differ ([] when the same)."""
        mine, theirs = _leaves(self.to_dict()), _leaves(other.to_dict())
        return [f"{key}: {mine.get(key)!r} != {theirs.get(key)!r}"
                for key in sorted(set(mine) | set(theirs))
                if not _same(mine.get(key), theirs.get(key))]


# -- the noise strategy and the selection it needs ---------------------------------------------
def noise_strategy(noise: Noise) -> NoiseStrategy | None:
    """The correlated noise strategy of `noise` (dptrain.privacy.noise: `toeplitz_column`,
    `to_dict()`, `name`, and `bands` when banded); None for independent noise, c = (1, 0, ...),
    which is charged as DP-SGD itself."""
    strategy = noise.strategy
    return None if isinstance(strategy, Independent) else strategy


def noise_bands(noise: Noise) -> int | None:
    """b of a banded noise strategy (each example may then take part at most once every b
    steps for the amplified accounting); None for other noise."""
    return strategy_bands(noise.strategy)


def selection_for(noise: Noise, sample_rate: float, kind: str | None = None,
                  groups: int | None = None,
                  schedule: Mapping[str, Any] | None = None) -> Selection:
    """The batch selection of a plan with `noise`, `kind` and `groups` as the user gave them
    (None: not given); `default_selection` of its noise's kind."""
    return default_selection(noise.strategy.name, sample_rate, kind, groups, schedule,
                             bands=noise_bands(noise))


def calibrated(plan: PrivacyPlan, epochs: float, tolerance: float = 0.01) -> PrivacyPlan:
    """`plan` with the smallest sigma whose `epochs` epochs spend at most its target epsilon at
    its delta (the plan's accountant and selection); UnreachableEpsilonError when none does."""
    sigma = get_noise_multiplier(target_epsilon=plan.noise.target_epsilon,
                                 target_delta=plan.delta, sample_rate=plan.selection.sample_rate,
                                 epochs=epochs, accountant=plan.accountant,
                                 epsilon_tolerance=tolerance, sampling=plan.accounting)
    return plan.with_noise_multiplier(sigma)


def planned_history(plan: PrivacyPlan, steps: int) -> History:
    """The runs of (sigma, q, steps) that `steps` steps of `plan` charge when every step runs:
    sigma and q of step t (0-based) from the plan's schedules, which are pure functions of t
    (dptrain.privacy.schedules), as the DP optimizer and the private loader evaluate them. What a
    run will spend is known before it reads any data (`dptrain tune` records it for every grid
    point). ConfigError for an uncalibrated plan or a Python schedule (only the caller's code
    knows its values)."""
    if plan.noise.multiplier is None:
        raise ConfigError("the plan's noise multiplier is not set yet: calibrate it first "
                          "(dptrain.privacy.plan.calibrated).")
    sigma_at = _recorded_schedule(plan.noise.schedule, plan.noise.multiplier, "noise_schedule")
    q_at = _recorded_schedule(plan.selection.schedule, plan.selection.sample_rate,
                              "sample_rate_schedule")
    if sigma_at is None and q_at is None:
        return merge_history([(plan.noise.multiplier, plan.selection.sample_rate, steps)])
    return merge_history(
        (plan.noise.multiplier if sigma_at is None else check_noise_multiplier(
            sigma_at(t), f"noise_schedule (value at step {t})"),
         plan.selection.sample_rate if q_at is None else check_sample_rate(
             q_at(t), f"sample_rate_schedule (value at step {t})"), 1)
        for t in range(int(steps)))


def _recorded_schedule(spec: Mapping[str, Any] | None, initial: float,
                       argument: str) -> Schedule | None:
    """The schedule a plan records (None: constant); ConfigError for a Python one."""
    if spec is not None and spec.get("kind") == "python":
        raise ConfigError(f"the plan's {argument} {spec.get('repr')} is Python code: its values "
                          "are not known from the plan.")
    return as_schedule(None if spec is None else dict(spec), initial, argument)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"part.field": value} of a nested plan dict."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and key != "schedule":
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values, floats compared to a relative 1e-12 (a JSON round trip)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b
