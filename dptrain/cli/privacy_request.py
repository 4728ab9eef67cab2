"""The `privacy` and `noise_schedule` groups parsed once into a `PrivacyRequest`, and that
request translated into the run's `PrivacyPlan` (`PrivacyRequest.plan`) once the data's size is
known.

Three modes: `epsilon` (sigma calibrated to privacy.target_epsilon), `sigma` (sigma given,
epsilon reported; an optional +privacy.target_epsilon caps it through the budget guard) and
`none` (the non-private baseline). Every key and value is checked here, before any data is
loaded; `dptrain.cli.build` then reads the typed request and never re-tests the mode's string.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from dptrain.accounting import ACCOUNTANTS
from dptrain.checks import (
    BOOLEAN,
    POSITIVE_INT,
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    one_of,
)
from dptrain.cli.schema import EpsilonPrivacyConfig, SigmaPrivacyConfig
from dptrain.data.user_sampling import check_max_examples_per_user
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.clipping import CLIPPING_MODES
from dptrain.privacy.noise import (
    NOISE_KINDS,
    Independent,
    check_noise_keys,
    noise_class,
    strategy_for,
)
from dptrain.privacy.plan import (
    COMMAND_SELECTIONS,
    GRAD_SAMPLE_MODES,
    Clipping,
    Noise,
    PrivacyPlan,
    Selection,
    Unit,
    default_selection,
)
from dptrain.privacy.schedules import as_schedule
from dptrain.privacy.selection import Shuffle
from dptrain.privacy.user_level import PRIVACY_UNITS

EPSILON, SIGMA, NONE = "epsilon", "sigma", "none"
PRIVACY_MODES = (EPSILON, SIGMA, NONE)
# Every key the `privacy` group may hold: the union of privacy/epsilon.yaml and privacy/sigma.yaml.
PRIVACY_KEYS = tuple(sorted({f.name for schema in (EpsilonPrivacyConfig, SigmaPrivacyConfig)
                             for f in dataclasses.fields(schema)}))

log = logging.getLogger(__name__)


def reject_unknown_keys(section: Mapping[str, Any], group: str, known: tuple[str, ...]) -> None:
    """ConfigError naming the first key of `section` that dptrain would silently ignore.

    Hydra refuses a misspelt key (`train.epoch=3`) but suggests `+train.epoch=3`, which adds it:
    such a key must not be ignored without a word.
    """
    unknown = sorted(set(section) - set(known))
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {group}.{close[0]}?" if close else ""
    raise ConfigError(
        f"config key {group}.{key} is not a {group} setting: dptrain would ignore it.{hint} "
        f"Remove it; the {group} keys are {', '.join(sorted(known))}."
    )


def privacy_mode(privacy: Mapping[str, Any]) -> str:
    """epsilon | sigma | none, from `privacy.name` or, for a hand-written group, from its keys."""
    mode = privacy.get("name")
    if mode is None:
        mode = (
            EPSILON
            if privacy.get("target_epsilon") is not None
            else (SIGMA if privacy.get("noise_multiplier") is not None else None)
        )
    if mode not in PRIVACY_MODES:
        raise ConfigError(
            f"privacy.name={mode!r}: the privacy config needs a target epsilon or a noise "
            f"multiplier. Use privacy=epsilon privacy.target_epsilon=3, privacy=sigma "
            f"privacy.noise_multiplier=1.0, or privacy=none for a non-private baseline."
        )
    return mode


def _required(privacy: Mapping[str, Any], mode: str, key: str) -> Any:
    """privacy.`key` (target_epsilon or noise_multiplier), which `mode` needs set."""
    value = privacy.get(key)
    if value is None:
        raise PrivacyError(
            f"privacy={mode} but privacy.{key} is null: DP-SGD needs either a target epsilon or a "
            f"noise multiplier. Set privacy.{key}=VALUE (e.g. privacy=epsilon "
            f"privacy.target_epsilon=3 or privacy=sigma privacy.noise_multiplier=1.0), or use "
            f"privacy=none for a non-private baseline."
        )
    return value


def _refuse_unused_sigma(privacy: Mapping[str, Any], mode: str) -> None:
    """privacy=epsilon calibrates sigma, so a noise_multiplier there (a config file that sets
    both, or `+privacy.noise_multiplier` composed without the command's rewrite,
    dptrain.cli.overrides) would be silently replaced: refused (ConfigError). privacy=sigma uses
    a target_epsilon as a cap enforced by the budget guard (said in the log)."""
    if mode == EPSILON and privacy.get("noise_multiplier") is not None:
        raise ConfigError(
            f"privacy=epsilon calibrates sigma to privacy.target_epsilon, so "
            f"privacy.noise_multiplier={privacy['noise_multiplier']} would not be used. To train "
            f"with that sigma use privacy=sigma privacy.noise_multiplier="
            f"{privacy['noise_multiplier']} (epsilon is reported; +privacy.target_epsilon=E adds "
            f"a cap); to calibrate sigma, remove privacy.noise_multiplier."
        )
    if mode == SIGMA and privacy.get("target_epsilon") is not None:
        log.info(
            "privacy=sigma with privacy.target_epsilon=%s: the budget guard stops training "
            "before the step that would exceed it.",
            privacy["target_epsilon"],
        )


@dataclass(frozen=True)
class PrivacyRequest:
    """What the config asks of the mechanism, checked (built by `PrivacyRequest.parse`)."""

    mode: str                                 # EPSILON | SIGMA | NONE
    target_epsilon: float | None = None       # EPSILON: the calibration target; SIGMA: a cap
    noise_multiplier: float | None = None     # SIGMA: sigma
    target_delta: float | None = None         # None: 1/(10 N) (dptrain.checks.default_delta)
    max_grad_norm: float | tuple[float, ...] = 1.0   # C, or per-layer bounds
    accountant: str = "prv"
    clipping: str = "flat"
    grad_sample_mode: str = "hooks"
    sampling: str | None = "poisson"          # poisson | shuffle | cyclic_poisson (None: the plan
                                              # picks, dptrain.privacy.plan.default_selection)
    sampling_groups: int | None = None        # cyclic_poisson: groups (None: the plan picks)
    secure_mode: bool = False
    reproducible_mechanism: bool = False      # noise and sampling seeded from train.seed (an opt-in)
    noise_schedule: Mapping[str, Any] | None = None  # the noise_schedule section (the ledger's)
    unit: str = "example"                     # "user": user-level DP (dptrain.privacy.user_level)
    max_examples_per_user: int | None = None  # unit=user: examples of a sampled user per batch
    noise: str = "independent"                # independent | banded | blt
    noise_bands: int | None = None            # noise=banded: b
    noise_buffers: int | None = None          # noise=blt: buffers (None: the default)

    @property
    def private(self) -> bool:
        """False for the non-private baseline (privacy=none)."""
        return self.mode != NONE

    @property
    def calibrated(self) -> bool:
        """True when sigma is calibrated to the target epsilon (privacy=epsilon)."""
        return self.mode == EPSILON

    @property
    def varying_noise(self) -> dict[str, Any] | None:
        """The noise schedule to give make_private; None for a constant sigma."""
        schedule = self.noise_schedule
        if not schedule or schedule.get("kind", "constant") == "constant":
            return None
        return dict(schedule)

    def plan(self, sample_rate: float, delta: float, steps: int | None = None,
             momentum: float = 0.0) -> PrivacyPlan:
        """The plan this request describes, for batches sampled at q = `sample_rate` and epsilon
        reported at `delta` (sigma still to calibrate with privacy=epsilon); a correlated noise
        strategy is optimised for `steps` steps (and SGD's `momentum`) and the participation
        schema of its batch selection (dptrain.privacy.plan.default_selection)."""
        norm = self.max_grad_norm
        selection = default_selection(self.noise, sample_rate, self.sampling,
                                      self.sampling_groups, bands=self.noise_bands)
        return PrivacyPlan(
            selection=selection,
            clipping=Clipping(max_grad_norm=norm, kind=self.clipping),
            noise=Noise(multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon,
                        schedule=self.varying_noise,
                        strategy=self._strategy(selection, steps, momentum)),
            accountant=self.accountant, delta=delta,
            randomness="secure" if self.secure_mode else
            ("reproducible" if self.reproducible_mechanism else "os_entropy"),
            unit=Unit(self.unit, max_examples_per_user=self.max_examples_per_user))

    def _strategy(self, selection: Selection, steps: int | None, momentum: float) -> Any:
        """The noise strategy of privacy.noise, optimised for `steps` steps and the separation
        of `selection`'s participations (independent noise needs none)."""
        if noise_class(self.noise) is not Independent and steps is None:
            raise ConfigError(f"privacy.noise={self.noise} is optimised for the run's number of "
                              "steps, which is not known here: set train.epochs.")
        return strategy_for(self.noise, steps or 1, bands=self.noise_bands,
                            buffers=self.noise_buffers,
                            steps_per_epoch=selection.min_separation, momentum=momentum)

    @classmethod
    def parse(cls, privacy: Mapping[str, Any],
              noise_schedule: Mapping[str, Any] | None = None) -> PrivacyRequest:
        """The request of the resolved `privacy` and `noise_schedule` sections; ConfigError or
        PrivacyError naming the key of any value that cannot be used."""
        mode = privacy_mode(privacy)
        if mode == NONE:
            return cls(NONE)
        reject_unknown_keys(privacy, "privacy", PRIVACY_KEYS)
        _refuse_unused_sigma(privacy, mode)
        key = "target_epsilon" if mode == EPSILON else "noise_multiplier"
        value = _required(privacy, mode, key)
        sigma = None if mode == EPSILON else check_noise_multiplier(value, "privacy.noise_multiplier")
        target = privacy.get("target_epsilon")
        target = None if target is None else check_epsilon(target, "privacy.target_epsilon",
                                                           target=True)
        delta = privacy.get("target_delta")
        clipping = one_of(*CLIPPING_MODES).check(privacy.get("clipping", "flat"), "privacy.clipping")
        norm = check_max_grad_norm(privacy.get("max_grad_norm", 1.0), "privacy.max_grad_norm",
                                   per_layer=clipping == "per_layer")
        return cls(
            mode=mode,
            target_epsilon=target,
            noise_multiplier=sigma,
            target_delta=None if delta is None else check_delta(delta, "privacy.target_delta"),
            max_grad_norm=tuple(norm) if isinstance(norm, list) else norm,
            accountant=one_of(*sorted(ACCOUNTANTS)).check(privacy.get("accountant", "prv"),
                                                          "privacy.accountant"),
            clipping=clipping,
            grad_sample_mode=one_of(*GRAD_SAMPLE_MODES).check(
                privacy.get("grad_sample_mode", "hooks"), "privacy.grad_sample_mode"),
            sampling=_sampling(privacy),
            sampling_groups=_sampling_groups(privacy),
            secure_mode=BOOLEAN.check(privacy.get("secure_mode", False), "privacy.secure_mode"),
            reproducible_mechanism=_reproducible_mechanism(privacy),
            noise_schedule=_checked_schedule(noise_schedule, mode, sigma),
            unit=one_of(*PRIVACY_UNITS).check(privacy.get("unit", "example"), "privacy.unit"),
            max_examples_per_user=check_max_examples_per_user(
                privacy.get("max_examples_per_user"), "privacy.max_examples_per_user"),
            **_noise_keys(privacy),
        )


def _noise_keys(privacy: Mapping[str, Any]) -> dict[str, Any]:
    """privacy.noise, noise_bands and noise_buffers, checked (a count given for another kind of
    noise is refused by dptrain.privacy.noise.strategy_for when the plan is built)."""
    counts = {key: POSITIVE_INT.or_none().check(privacy.get(key), f"privacy.{key}")
              for key in ("noise_bands", "noise_buffers")}
    kind = one_of(*NOISE_KINDS).check(privacy.get("noise", "independent"), "privacy.noise")
    check_noise_keys(kind, bands=counts["noise_bands"], buffers=counts["noise_buffers"])
    return {"noise": kind, **counts}


#: what privacy.poisson_sampling=false (the older name) means: privacy.sampling=shuffle
POISSON_SAMPLING_FALSE = Shuffle.kind


def _sampling(privacy: Mapping[str, Any]) -> str | None:
    """`privacy.sampling` (poisson | shuffle | cyclic_poisson), or its alias
    `privacy.poisson_sampling` (false: shuffle); None when neither is set (the plan picks:
    cyclic Poisson for banded and BLT noise, else Poisson); ConfigError for sampling=poisson
    with poisson_sampling=false."""
    alias = BOOLEAN.check(privacy.get("poisson_sampling", True), "privacy.poisson_sampling")
    sampling = privacy.get("sampling")
    if sampling is None:
        return None if alias else POISSON_SAMPLING_FALSE
    sampling = one_of(*COMMAND_SELECTIONS).check(sampling, "privacy.sampling")
    if sampling != POISSON_SAMPLING_FALSE and not alias:
        raise ConfigError(f"privacy.sampling={sampling} but privacy.poisson_sampling={str(alias).lower()} "
                          "(its older name) says otherwise: set privacy.sampling alone.")
    return sampling


def _sampling_groups(privacy: Mapping[str, Any]) -> int | None:
    """`privacy.sampling_groups`: None, or a count >= 1 (dptrain.checks.POSITIVE_INT)."""
    groups = privacy.get("sampling_groups")
    return None if groups is None else POSITIVE_INT.check(groups, "privacy.sampling_groups")


def _reproducible_mechanism(privacy: Mapping[str, Any]) -> bool:
    """`privacy.reproducible_mechanism`, checked to be a bool and not combined with secure mode."""
    reproducible = BOOLEAN.check(privacy.get("reproducible_mechanism", False),
                                 "privacy.reproducible_mechanism")
    if reproducible and privacy.get("secure_mode", False):
        raise ConfigError("privacy.reproducible_mechanism=true cannot be combined with "
                          "privacy.secure_mode=true: secure mode draws all noise and sampling "
                          "from the OS CSPRNG. Set one of them to false.")
    return reproducible


def _checked_schedule(schedule: Mapping[str, Any] | None, mode: str,
                      sigma: float | None) -> dict[str, Any]:
    """The `noise_schedule` section, checked: a varying sigma needs privacy=sigma and parameters
    its schedule accepts (built once here to find out)."""
    if not schedule or schedule.get("kind", "constant") == "constant":
        return dict(schedule or {})
    if mode == EPSILON:
        raise ConfigError(
            f"noise_schedule={schedule.get('kind')} needs privacy=sigma: calibrating sigma to "
            f"privacy.target_epsilon assumes a constant sigma. Use privacy=sigma "
            f"privacy.noise_multiplier=VALUE with this schedule, or noise_schedule=constant."
        )
    as_schedule(dict(schedule), sigma, "noise_schedule")
    return dict(schedule)
