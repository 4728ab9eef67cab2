"""The `privacy` group -> the plan's parts: the CLI's one translation of its privacy config.

The group mirrors the plan (dptrain.privacy.plan), one mapping per part:

    privacy.budget:   {sigma: 1.0} | {target_epsilon: 3.0}, and delta   -> Noise, the plan's delta
    privacy.sampling: {kind: poisson | shuffle | cyclic_poisson | balls_in_bins, groups}   -> Selection
    privacy.noise:    {kind: independent | banded | blt, bands, buffers} -> Noise.strategy
    privacy.unit:     {kind: example | user, max_examples_per_user}     -> Unit
    privacy.max_grad_norm, privacy.clipping                             -> Clipping
    privacy.accountant, secure_mode / reproducible_mechanism            -> accountant, randomness

`PrivacyGroup.parse` checks every value (ConfigError or PrivacyError naming the key) and builds
the parts that need no data (Unit, Clipping); `PrivacyGroup.plan` builds the others once the
data fixes q and the number of steps. The sampling kinds are the plan's (COMMAND_SELECTIONS).

Three modes, from `privacy.name`: epsilon (sigma calibrated to budget.target_epsilon), sigma
(sigma given, epsilon reported; a budget.target_epsilon is a cap the budget guard enforces) and
none (the non-private baseline).

The older flat names (dptrain.train.ledger.hashing.FLAT_PRIVACY_KEYS: privacy.noise_multiplier,
privacy.noise_bands, privacy.sampling=shuffle as one word, ...) are aliases, read here and only
here (`canonical`): an alias that is given (its `???` default means not given) replaces its
nested key when that key is null or at its option's default, and is refused in one paragraph
when the nested key says something else. The folded, nested section is what the ledger records
(`PrivacyGroup.section`), so a run and its resume compare alike whichever names they used.
Messages name a key the way the user spelled its part (flat or nested).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf, open_dict

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
from dptrain.cli.schema import (
    PLAN_PARTS,
    EpsilonBudgetConfig,
    EpsilonPrivacyConfig,
    SigmaBudgetConfig,
    SigmaPrivacyConfig,
)
from dptrain.data.user_sampling import check_max_examples_per_user
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.clipping import CLIPPING_MODES
from dptrain.privacy.noise import (
    NOISE_KINDS,
    Independent,
    NoiseStrategy,
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
from dptrain.privacy.unit import unit_class
from dptrain.train.ledger.hashing import FLAT_PRIVACY_KEYS, POISSON_SAMPLING

EPSILON, SIGMA, NONE = "epsilon", "sigma", "none"
PRIVACY_MODES = (EPSILON, SIGMA, NONE)
PARTS = ("budget", *PLAN_PARTS)       # the nested parts, in the order the ledger shows them
BUDGET_KEYS = tuple(f.name for f in dataclasses.fields(SigmaBudgetConfig))
# Every key the `privacy` group may hold: the union of privacy/epsilon.yaml and privacy/sigma.yaml.
PRIVACY_KEYS = tuple(sorted({f.name for schema in (EpsilonPrivacyConfig, SigmaPrivacyConfig)
                             for f in dataclasses.fields(schema)}))
# Older flat name -> (part, key): privacy.noise_bands -> ("noise", "bands"). A part's own name
# (privacy.noise=banded) is its kind given as one word, read with the part.
ALIASES: dict[str, tuple[str, str]] = {
    flat.removeprefix("privacy."): tuple(nested.removeprefix("privacy.").split("."))  # type: ignore[misc]
    for flat, nested in FLAT_PRIVACY_KEYS.items() if flat.removeprefix("privacy.") not in PARTS}
POISSON_ALIAS = POISSON_SAMPLING[0].removeprefix("privacy.")   # false: sampling.kind shuffle
ALIAS_KEYS = (*ALIASES, POISSON_ALIAS)
UNSET = "???"   # an alias's default: not given (OmegaConf's missing value)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- the group's keys
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


def _budget_value(privacy: Mapping[str, Any], key: str, alias: str) -> Any:
    """budget.`key` of a section, or its older flat name `alias` (a hand-written group)."""
    budget = privacy.get("budget")
    nested = budget.get(key) if isinstance(budget, Mapping) else None
    return nested if nested is not None else privacy.get(alias)


def privacy_mode(privacy: Mapping[str, Any]) -> str:
    """epsilon | sigma | none, from `privacy.name` or, for a hand-written group, from its
    budget (budget.target_epsilon or budget.sigma, or their flat names)."""
    mode = privacy.get("name")
    if mode is None:
        if _budget_value(privacy, "target_epsilon", "target_epsilon") is not None:
            mode = EPSILON
        elif _budget_value(privacy, "sigma", "noise_multiplier") is not None:
            mode = SIGMA
    if mode not in PRIVACY_MODES:
        raise ConfigError(
            f"privacy.name={mode!r}: the privacy config needs a target epsilon or a noise "
            f"multiplier. Use privacy=epsilon privacy.budget.target_epsilon=3, privacy=sigma "
            f"privacy.budget.sigma=1.0, or privacy=none for a non-private baseline."
        )
    return mode


def without_unset_aliases(cfg: DictConfig) -> DictConfig:
    """A copy of the composed config without the privacy aliases left at `???` (not given), so
    that resolving it refuses only the missing values a user must set."""
    privacy = cfg.get("privacy")
    if not isinstance(privacy, DictConfig):
        return cfg
    keys = set(privacy.keys())   # `in` is False for a missing value
    unset = [key for key in ALIAS_KEYS if key in keys and OmegaConf.is_missing(privacy, key)]
    if not unset:
        return cfg
    copy = cfg.copy()
    with open_dict(copy.privacy):
        for key in unset:
            del copy.privacy[key]
    return copy


# ----------------------------------------------------------------------------- flat -> nested
@dataclass(frozen=True)
class Spelling:
    """How the user spelled each part: `flat` holds the parts given by an older flat name (an
    alias, or the part as one word); their keys are named that way in messages."""

    flat: frozenset[str] = frozenset()

    def key(self, path: str) -> str:
        """The config key of `path` ("noise.bands") as the user spelled its part:
        privacy.noise_bands, or privacy.noise.bands."""
        part, _, sub = path.partition(".")
        if part in self.flat:
            if sub == "kind":
                return f"privacy.{part}"
            for alias, nested in ALIASES.items():
                if nested == (part, sub):
                    return f"privacy.{alias}"
        return f"privacy.{path}"


def _nested_default(mode: str, part: str, key: str) -> Any:
    """The value option `mode` gives privacy.`part`.`key` (the schema's, which the yaml repeats)."""
    if part == "budget":
        budget = SigmaBudgetConfig if mode == SIGMA else EpsilonBudgetConfig
        return getattr(budget(), key)
    return PLAN_PARTS[part][key]


def _part(privacy: Mapping[str, Any], part: str) -> tuple[dict[str, Any], bool]:
    """(privacy.`part` as a full mapping, whether it was given as one word: its kind)."""
    value = privacy.get(part)
    keys = BUDGET_KEYS if part == "budget" else tuple(PLAN_PARTS[part])
    defaults = {key: None for key in BUDGET_KEYS} if part == "budget" else dict(PLAN_PARTS[part])
    if value is None:
        return defaults, False
    if part != "budget" and isinstance(value, str):
        return {**defaults, "kind": value}, True
    if not isinstance(value, Mapping):
        raise ConfigError(f"privacy.{part}={value!r} is not accepted: privacy.{part} takes a "
                          f"mapping of {', '.join(keys)} (e.g. privacy.{part}.{keys[0]}=...).")
    reject_unknown_keys(value, f"privacy.{part}", keys)
    return {**defaults, **value}, False


def _alias_value(alias: str, given: Any) -> Any:
    """What an alias's value says of its nested key (poisson_sampling=false: shuffle; true:
    nothing, None); other aliases as given."""
    if alias != POISSON_ALIAS:
        return given
    return POISSON_SAMPLING[2] if not BOOLEAN.check(given, f"privacy.{alias}") else None


def _fold_alias(parts: dict[str, dict[str, Any]], mode: str, alias: str, given: Any,
                words: set[str]) -> None:
    """Read the older flat key privacy.`alias`=`given` into `parts` (in place): it replaces a
    nested key that is null or at its option's default; ConfigError when they disagree.
    `words`: the parts given as one word (named privacy.PART in the message)."""
    part, key = ("sampling", "kind") if alias == POISSON_ALIAS else ALIASES[alias]
    value = _alias_value(alias, given)
    nested = parts[part][key]
    if (value is None and alias == POISSON_ALIAS) or nested == value:
        return
    if nested is None or nested == _nested_default(mode, part, key):
        parts[part][key] = value
        return
    nested_key = f"privacy.{part}" if part in words else f"privacy.{part}.{key}"
    meaning = " (false: shuffle)" if alias == POISSON_ALIAS else ""
    raise ConfigError(
        f"privacy.{alias}={_shown(given)} and {nested_key}={_shown(nested)} disagree: "
        f"privacy.{alias} is the older name of privacy.{part}.{key}{meaning}, so both set the "
        f"same thing. Set {nested_key} alone (privacy.{part}.{key}={_shown(value)} says what "
        f"privacy.{alias}={_shown(given)} said), or drop it and keep privacy.{alias}.")


def _shown(value: Any) -> str:
    """A value as a command line writes it (null, true, false)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def canonical(privacy: Mapping[str, Any]) -> tuple[dict[str, Any], Spelling]:
    """(the privacy group in its nested form, how its parts were spelled): every part a full
    mapping, the aliases read into them and dropped (privacy=none: as it is)."""
    mode = privacy_mode(privacy)
    if mode == NONE:
        return dict(privacy), Spelling()
    reject_unknown_keys(privacy, "privacy", PRIVACY_KEYS)
    parts, words = {}, set()
    for part in PARTS:
        parts[part], word = _part(privacy, part)
        if word:
            words.add(part)
    given = [alias for alias in ALIAS_KEYS if privacy.get(alias, UNSET) != UNSET]
    for alias in given:
        _fold_alias(parts, mode, alias, privacy[alias], words)
    flat = words | {"sampling" if alias == POISSON_ALIAS else ALIASES[alias][0] for alias in given}
    rest = {key: value for key, value in privacy.items()
            if key not in PARTS and key not in ALIAS_KEYS and key != "name"}
    head = {"name": privacy["name"]} if "name" in privacy else {}
    return {**head, **parts, **rest}, Spelling(frozenset(flat))


def canonical_section(privacy: Mapping[str, Any]) -> dict[str, Any]:
    """The privacy group in its nested form (`canonical`), as the ledger records it."""
    return canonical(privacy)[0]


# ----------------------------------------------------------------------------- the checked group
@dataclass(frozen=True)
class Budget:
    """privacy.budget, checked: sigma (given) or target_epsilon (to calibrate to; with a sigma,
    a cap), and delta (None: 1/(10 N), dptrain.checks.default_delta)."""

    sigma: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None


@dataclass(frozen=True)
class PrivacyGroup:
    """The privacy group checked, as the plan's parts (built by `PrivacyGroup.parse`): the unit
    and the clipping built; the selection and the noise by `plan` once q and the steps are known."""

    mode: str                                   # EPSILON | SIGMA | NONE
    section: Mapping[str, Any]                  # the nested form (what the ledger records)
    budget: Budget = Budget()
    unit: Unit = Unit()
    clipping: Clipping = Clipping()
    sampling: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: dict(PLAN_PARTS["sampling"]))
    noise: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: dict(PLAN_PARTS["noise"]))
    accountant: str = "prv"
    randomness: str = "os_entropy"
    grad_sample_mode: str = "hooks"
    noise_schedule: Mapping[str, Any] | None = None   # the noise_schedule section (the ledger's)
    spelling: Spelling = Spelling()

    @property
    def private(self) -> bool:
        """False for the non-private baseline (privacy=none)."""
        return self.mode != NONE

    @property
    def calibrated(self) -> bool:
        """True when sigma is calibrated to the target epsilon (privacy=epsilon)."""
        return self.mode == EPSILON

    @property
    def target_delta(self) -> float | None:
        """budget.delta (None: the 1/(10 N) rule)."""
        return self.budget.delta

    def key(self, path: str) -> str:
        """The config key of `path` ("budget.delta") as the user spelled it."""
        return self.spelling.key(path)

    @property
    def varying_noise(self) -> dict[str, Any] | None:
        """The noise schedule to give make_private; None for a constant sigma."""
        schedule = self.noise_schedule
        if not schedule or schedule.get("kind", "constant") == "constant":
            return None
        return dict(schedule)

    # -- the parts that need the data -----------------------------------------------------------
    def selection(self, sample_rate: float) -> Selection:
        """The batch selection at q = `sample_rate`: privacy.sampling, or the noise's default
        (dptrain.privacy.plan.default_selection)."""
        return default_selection(self.noise["kind"], sample_rate, self.sampling["kind"],
                                 self.sampling["groups"], bands=self.noise["bands"])

    def noise_strategy(self, selection: Selection, steps: int | None,
                       momentum: float = 0.0) -> NoiseStrategy:
        """The strategy of privacy.noise, optimised for `steps` steps (and SGD's `momentum`)
        and the separation of `selection`'s participations (independent noise needs none)."""
        if noise_class(self.noise["kind"]) is not Independent and steps is None:
            raise ConfigError(f"{self.key('noise.kind')}={self.noise['kind']} is optimised for "
                              "the run's number of steps, which is not known here: set "
                              "train.epochs.")
        return strategy_for(self.noise["kind"], steps or 1, bands=self.noise["bands"],
                            buffers=self.noise["buffers"],
                            steps_per_epoch=selection.min_separation, momentum=momentum)

    def plan(self, sample_rate: float, delta: float, steps: int | None = None,
             momentum: float = 0.0) -> PrivacyPlan:
        """The plan of this group for batches sampled at q = `sample_rate` and epsilon stated at
        `delta` (sigma still to calibrate with privacy=epsilon); a correlated noise strategy is
        optimised for `steps` steps, SGD's `momentum` and its selection's participations."""
        selection = self.selection(sample_rate)
        return PrivacyPlan(
            selection=selection, clipping=self.clipping,
            noise=Noise(multiplier=self.budget.sigma, target_epsilon=self.budget.target_epsilon,
                        schedule=self.varying_noise,
                        strategy=self.noise_strategy(selection, steps, momentum)),
            accountant=self.accountant, delta=delta, randomness=self.randomness, unit=self.unit)

    # -- parsing ----------------------------------------------------------------------------------
    @classmethod
    def parse(cls, privacy: Mapping[str, Any],
              noise_schedule: Mapping[str, Any] | None = None) -> PrivacyGroup:
        """The group of the resolved `privacy` section (nested, flat or mixed) and the
        `noise_schedule` section; ConfigError or PrivacyError naming the key of any value that
        cannot be used."""
        section, spelling = canonical(privacy)
        mode = privacy_mode(section)
        if mode == NONE:
            return cls(NONE, section)
        budget = _budget(section, mode, spelling)
        return cls(
            mode=mode, section=section, budget=budget,
            unit=_unit(section["unit"], spelling),
            clipping=_clipping(section),
            sampling=_sampling(section["sampling"], spelling),
            noise=_noise(section["noise"], spelling),
            accountant=one_of(*sorted(ACCOUNTANTS)).check(section.get("accountant", "prv"),
                                                          "privacy.accountant"),
            randomness=_randomness(section),
            grad_sample_mode=one_of(*GRAD_SAMPLE_MODES).check(
                section.get("grad_sample_mode", "hooks"), "privacy.grad_sample_mode"),
            noise_schedule=_checked_schedule(noise_schedule, mode, budget.sigma),
            spelling=spelling)


# ----------------------------------------------------------------------------- one part each
def _budget(section: Mapping[str, Any], mode: str, spelling: Spelling) -> Budget:
    """privacy.budget checked for `mode`: the value the mode needs is set, a sigma that
    calibration would replace is refused, a target epsilon with a sigma is a cap (logged)."""
    budget = section["budget"]
    sigma_key, target_key = spelling.key("budget.sigma"), spelling.key("budget.target_epsilon")
    if mode == EPSILON and budget["sigma"] is not None:
        raise ConfigError(
            f"privacy=epsilon calibrates sigma to {target_key}, so {sigma_key}={budget['sigma']} "
            f"would not be used. To train with that sigma use privacy=sigma {sigma_key}="
            f"{budget['sigma']} (epsilon is reported; {target_key}=E adds a cap); to calibrate "
            f"sigma, remove {sigma_key}.")
    needed, needed_key = (("target_epsilon", target_key) if mode == EPSILON
                          else ("sigma", sigma_key))
    if budget[needed] is None:
        raise PrivacyError(
            f"privacy={mode} but {needed_key} is null: DP-SGD needs either a target epsilon or a "
            f"noise multiplier. Set {needed_key}=VALUE (e.g. privacy=epsilon {target_key}=3 or "
            f"privacy=sigma {sigma_key}=1.0), or use privacy=none for a non-private baseline.")
    if mode == SIGMA and budget["target_epsilon"] is not None:
        log.info("privacy=sigma with %s=%s: the budget guard stops training before the step "
                 "that would exceed it.", target_key, budget["target_epsilon"])
    target, delta = budget["target_epsilon"], budget["delta"]
    return Budget(
        sigma=None if mode == EPSILON else check_noise_multiplier(budget["sigma"], sigma_key),
        target_epsilon=None if target is None else check_epsilon(target, target_key, target=True),
        delta=None if delta is None else check_delta(delta, spelling.key("budget.delta")))


def _unit(unit: Mapping[str, Any], spelling: Spelling) -> Unit:
    """privacy.unit -> the plan's Unit (its kind and cap checked under the user's key names)."""
    kind = unit_class(unit["kind"], spelling.key("unit.kind")).kind
    cap = check_max_examples_per_user(unit["max_examples_per_user"],
                                      spelling.key("unit.max_examples_per_user"))
    return Unit(kind, max_examples_per_user=cap)


def _clipping(section: Mapping[str, Any]) -> Clipping:
    """privacy.clipping and privacy.max_grad_norm -> the plan's Clipping."""
    kind = one_of(*CLIPPING_MODES).check(section.get("clipping", "flat"), "privacy.clipping")
    norm = check_max_grad_norm(section.get("max_grad_norm", 1.0), "privacy.max_grad_norm",
                               per_layer=kind == "per_layer")
    return Clipping(max_grad_norm=tuple(norm) if isinstance(norm, list) else norm, kind=kind)


def sampling_kind(kind: Any, key: str = "privacy.sampling.kind") -> str | None:
    """A command's batch selection: None (the noise picks), or one of the plan's
    COMMAND_SELECTIONS (the caller's own loader, `given`, is Python-only)."""
    return None if kind is None else one_of(*COMMAND_SELECTIONS).check(kind, key)


def _sampling(sampling: Mapping[str, Any], spelling: Spelling) -> dict[str, Any]:
    """privacy.sampling checked: its kind (None: the noise picks) and groups (None or >= 1)."""
    groups = sampling["groups"]
    return {"kind": sampling_kind(sampling["kind"], spelling.key("sampling.kind")),
            "groups": None if groups is None else POSITIVE_INT.check(
                groups, spelling.key("sampling.groups"))}


def _noise(noise: Mapping[str, Any], spelling: Spelling) -> dict[str, Any]:
    """privacy.noise checked: its kind, and the count that kind takes (bands: banded, required;
    buffers: blt) and no other."""
    counts = {key: POSITIVE_INT.or_none().check(noise[key], spelling.key(f"noise.{key}"))
              for key in ("bands", "buffers")}
    kind_key = spelling.key("noise.kind")
    kind = one_of(*NOISE_KINDS).check(noise["kind"], kind_key)
    check_noise_keys(kind, bands=counts["bands"], buffers=counts["buffers"],
                     keys=(kind_key, spelling.key("noise.bands"), spelling.key("noise.buffers")))
    return {"kind": kind, **counts}


def _randomness(section: Mapping[str, Any]) -> str:
    """The plan's randomness: secure (privacy.secure_mode), reproducible
    (privacy.reproducible_mechanism: seeded from train.seed, an opt-in) or os_entropy."""
    secure = BOOLEAN.check(section.get("secure_mode", False), "privacy.secure_mode")
    reproducible = BOOLEAN.check(section.get("reproducible_mechanism", False),
                                 "privacy.reproducible_mechanism")
    if reproducible and secure:
        raise ConfigError("privacy.reproducible_mechanism=true cannot be combined with "
                          "privacy.secure_mode=true: secure mode draws all noise and sampling "
                          "from the OS CSPRNG. Set one of them to false.")
    return "secure" if secure else ("reproducible" if reproducible else "os_entropy")


def _checked_schedule(schedule: Mapping[str, Any] | None, mode: str,
                      sigma: float | None) -> dict[str, Any]:
    """The `noise_schedule` section, checked: a varying sigma needs privacy=sigma and parameters
    its schedule accepts (built once here to find out)."""
    if not schedule or schedule.get("kind", "constant") == "constant":
        return dict(schedule or {})
    if mode == EPSILON:
        raise ConfigError(
            f"noise_schedule={schedule.get('kind')} needs privacy=sigma: calibrating sigma to "
            f"privacy.budget.target_epsilon assumes a constant sigma. Use privacy=sigma "
            f"privacy.budget.sigma=VALUE with this schedule, or noise_schedule=constant."
        )
    as_schedule(dict(schedule), sigma, "noise_schedule")
    return dict(schedule)
