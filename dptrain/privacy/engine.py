"""PrivacyEngine and make_private: the two-line Python API of DP-SGD.

    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    ...  # the user's training loop, unchanged
    engine.get_epsilon(delta=1e-5)

`make_private` validates everything up front, wraps the model in the per-sample gradient module
("hooks": GradSampleModule; "ghost": GhostClippingModule), rebuilds the loader with Poisson
sampling, wraps the optimizer in a DPOptimizer whose every real step steps the accountant with
the sigma and q actually used, and fixes the public expected batch size q * N once.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from dptrain.accounting import get_accountant
from dptrain.accounting.events import AccountingEvent
from dptrain.data.given_shuffle import given_shuffle_rate
from dptrain.data.sampling import dataset_size, default_sample_rate
from dptrain.distributed.ddp import unwrap_ddp
from dptrain.distributed.fsdp import is_fully_sharded, sharded_source
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.checks import (
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    check_sample_rate,
)
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.charge import Charge
from dptrain.privacy.clipping import make_clipper
from dptrain.privacy.distributed import DistributedDPOptimizer, ShardedDPOptimizer
from dptrain.privacy.noise import NoiseStrategy, strategy_from_dict
from dptrain.randomness import derive_seeds, make_generator
from dptrain.privacy.optimizer import DPOptimizer
from dptrain.privacy.plan import (  # noqa: F401  (GRAD_SAMPLE_MODES: re-exported, its old home)
    GRAD_SAMPLE_MODES,
    Clipping,
    Noise,
    PerformanceSettings,
    PrivacyPlan,
    Selection,
    Unit,
    calibrated,
    selection_for,
)
from dptrain.privacy.schedules import Schedule, as_schedule
from dptrain.privacy.selection import Given, GivenShuffle, LoaderContext, selection_class
_INTERFACE = ("per_sample_batch_size", "squared_norms", "weighted_sum", "clear_per_sample",
              "check_complete")
ScheduleSpec = Schedule | Callable[[int], float] | dict[str, Any] | None
# make_private's keyword arguments that describe the plan (the others say how it is computed).
_PLAN_ARGUMENTS = ("max_grad_norm", "poisson_sampling", "sampling", "sampling_groups", "clipping",
                   "privacy_unit", "max_examples_per_user", "noise_strategy",
                   "target_unclipped_quantile", "clipbound_learning_rate", "count_noise_std")


class Default:
    """A keyword argument's default value, told apart from the same value given by the caller:
    make_private refuses a keyword given beside a plan that contradicts it (`_beside_plan`), and
    only a given keyword can. Shown as the value itself in signatures and docs."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def given_value(argument: Any) -> Any:
    """The value of a keyword argument (a `Default`'s own value)."""
    return argument.value if isinstance(argument, Default) else argument


def is_given(argument: Any) -> bool:
    """Whether the caller gave a keyword argument (None and a `Default` are not given)."""
    return argument is not None and not isinstance(argument, Default)


def schedule_spec(spec: ScheduleSpec) -> dict[str, Any] | None:
    """A schedule argument as the plan records it: a dict as is (constant: None); a Schedule or
    a Python callable by its repr (kind "python": the plan then names it but cannot rebuild it)."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return None if spec.get("kind", "constant") == "constant" and len(spec) <= 1 else dict(spec)
    return {"kind": "python", "repr": repr(spec)}


def _as_spec(recorded: Any) -> dict[str, Any] | None:
    """The schedule argument of a plan's recorded schedule (a "python" one cannot be rebuilt)."""
    if recorded is None:
        return None
    if recorded.get("kind") == "python":
        raise ConfigError(f"the plan's schedule {recorded['repr']} is a Python object: pass it "
                          "again to make_private (noise_schedule= or sample_rate_schedule=).")
    return dict(recorded)


def _sampling_agrees(poisson_sampling: bool, kind: str) -> bool:
    """Whether poisson_sampling=`poisson_sampling` agrees with a plan's selection `kind`: False
    (the caller's loader, or a shuffle) contradicts batches amplified by (cyclic) Poisson
    sampling; True contradicts the caller's own loader accounted as Poisson without proof."""
    selection = selection_class(kind)
    return selection.proven if poisson_sampling else not selection.amplified


def _recorded_norm(value: Any) -> Any:
    """max_grad_norm as a plan records it: a float, or a tuple of per-layer bounds."""
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else float(value)


def _optional_int(value: Any) -> Any:
    return value if value is None else int(value)


# make_private's keywords that describe a plan: the plan's field each sets, that field's value
# in a plan, and the keyword's value as the plan records it (poisson_sampling: _sampling_agrees)
_PLAN_FIELDS: dict[str, tuple[str, Callable[[PrivacyPlan], Any], Callable[[Any], Any]]] = {
    "noise_multiplier": ("noise.multiplier", lambda p: p.noise.multiplier, float),
    "noise_strategy": ("noise.strategy", lambda p: p.noise.strategy, strategy_from_dict),
    "noise_schedule": ("noise.schedule", lambda p: p.noise.schedule, schedule_spec),
    "max_grad_norm": ("clipping.max_grad_norm", lambda p: p.clipping.max_grad_norm,
                      _recorded_norm),
    "clipping": ("clipping.kind", lambda p: p.clipping.kind, str),
    "target_unclipped_quantile": ("clipping.target_unclipped_quantile",
                                  lambda p: p.clipping.target_unclipped_quantile, float),
    "clipbound_learning_rate": ("clipping.clipbound_learning_rate",
                                lambda p: p.clipping.clipbound_learning_rate, float),
    "count_noise_std": ("clipping.count_noise_std", lambda p: p.clipping.count_noise_std, float),
    "sampling": ("selection.kind", lambda p: p.selection.kind, str),
    "sampling_groups": ("selection.groups", lambda p: p.selection.groups, int),
    "sample_rate_schedule": ("selection.schedule", lambda p: p.selection.schedule,
                             schedule_spec),
    "privacy_unit": ("unit.kind", lambda p: p.unit.kind, str),
    "max_examples_per_user": ("unit.max_examples_per_user",
                              lambda p: p.unit.max_examples_per_user, _optional_int),
}


def _is_python(schedule: Any) -> bool:
    return isinstance(schedule, Mapping) and schedule.get("kind") == "python"


def _with_schedule(plan: PrivacyPlan, name: str, spec: dict[str, Any]) -> PrivacyPlan:
    """`plan` recording `spec` as its noise (name "noise_schedule") or sample-rate schedule."""
    if name == "noise_schedule":
        return dataclasses.replace(plan, noise=dataclasses.replace(plan.noise, schedule=spec))
    return dataclasses.replace(plan, selection=dataclasses.replace(plan.selection, schedule=spec))


def beside_plan(plan: PrivacyPlan, given: Mapping[str, Any]) -> PrivacyPlan:
    """`plan` once the keywords `given` beside it (name -> value, each given by the caller) are
    checked against it: ConfigError naming the first that contradicts the plan (the engine
    would run one mechanism and record another). A Python schedule, which a recorded plan names
    but cannot rebuild, must be given again: it is taken from the keyword and recorded."""
    for name, value in given.items():
        if name == "poisson_sampling":
            if not _sampling_agrees(_check_flag(name, value), plan.selection.kind):
                raise _contradiction(name, value, "selection.kind", plan.selection.kind)
            continue
        field, planned, recorded = _PLAN_FIELDS[name]
        mine, theirs = recorded(value), planned(plan)
        if _is_python(mine) and _is_python(theirs):
            plan = _with_schedule(plan, name, mine)
        elif mine != theirs:
            raise _contradiction(name, value, field, theirs)
    return plan


def _contradiction(name: str, value: Any, field: str, planned: Any) -> ConfigError:
    return ConfigError(
        f"{name}={value!r} differs from the plan's {field} ({planned!r}): make_private(plan=...) "
        "runs and records the plan, so a keyword given beside it must agree with it. Drop "
        f"{name}, or put it in the plan (engine.plan_of(data_loader, {name}=..., ...) builds "
        "one from keywords).")


def _make_accountant(accountant: Any) -> Any:
    """An accountant from its name ("prv" | "rdp" | "gdp"), or an accountant object as is."""
    if not isinstance(accountant, str):
        return accountant
    return get_accountant(accountant)


def accountant_for(accountant: Any, event: AccountingEvent) -> Any:
    """The accountant that charges steps as `event` (the plan's selection and noise strategy),
    carrying `accountant`'s name: `accountant` itself when the event charges steps with the
    configured accountant (plain DP-SGD: a caller's own accountant object is kept) or when it
    already charges them as `event`, otherwise a new one from `get_accountant(name, event)`
    holding `accountant`'s history."""
    own = event.traits.accountant  # a selection's own accountant (shuffle, random allocation)
    if event.plain and own is None:
        return accountant
    current = getattr(accountant, "event", None)
    if current == event or (event.plain and getattr(accountant, "sampling", None) == own.sampling):
        return accountant
    charged = get_accountant(accountant.name, event)
    charged.load_state_dict({"name": charged.name, "history": accountant.history})
    return charged


def optimizer_class(distributed: bool, sharded: bool = False) -> type:
    """The DP optimizer of a model: one process, DDP (clipped sums all-reduced, noise added
    once) or a fully sharded (FSDP2) one (reduce-scattered, each rank noising its rows)."""
    if not distributed:
        return DPOptimizer
    return ShardedDPOptimizer if sharded else DistributedDPOptimizer


def warn_if_delta_too_large(delta: float, num_samples: int | None, argument: str) -> None:
    """PrivacyError for delta outside (0, 1); a warning when delta >= 1/N."""
    check_delta(delta, argument)
    if num_samples and delta >= 1.0 / num_samples:
        warnings.warn(f"{argument}={delta} is not below 1/N = {1.0 / num_samples:.3g} (N = "
                      f"{num_samples} examples): a mechanism that publishes one random example "
                      f"satisfies that delta. Use delta well below 1/N, e.g. {0.1 / num_samples:.1g}.",
                      UserWarning, stacklevel=3)


def _wrap_module(module: nn.Module, grad_sample_mode: str, batch_first: bool,
                 loss_reduction: str, sharded: bool = False) -> Any:
    """The per-sample gradient module for `grad_sample_mode` (a wrapped module is kept as is; a
    fully sharded model gets its hooks on the gathered parameters, dptrain.distributed.fsdp)."""
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ConfigError(f"grad_sample_mode={grad_sample_mode!r} is unknown; use one of "
                          f"{list(GRAD_SAMPLE_MODES)}.")
    if sharded:
        return sharded_source(module, grad_sample_mode, batch_first, loss_reduction)
    if all(callable(getattr(module, name, None)) for name in _INTERFACE):
        return module
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    wrapper = GradSampleModule if grad_sample_mode == "hooks" else GhostClippingModule
    return wrapper(module, batch_first=batch_first, loss_reduction=loss_reduction)


def _trainable_parameters(source: Any) -> list[tuple[str, nn.Parameter]]:
    """(name, param) of the wrapped module's trainable parameters, in model order."""
    if callable(getattr(source, "trainable_parameters", None)):
        return list(source.trainable_parameters())
    return [(n, p) for n, p in source.named_parameters() if p.requires_grad]


def _check_optimizer_params(optimizer: Optimizer, module: nn.Module,
                            named: list[tuple[str, nn.Parameter]]) -> None:
    """ConfigError unless the optimizer holds every trainable parameter of the module and
    nothing outside the module (frozen parameters of the module may be held: they get no noise)."""
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    in_module = {id(p) for p in module.parameters()}
    missing = [n for n, p in named if id(p) not in in_optimizer]
    foreign = len(in_optimizer - in_module)
    if missing or foreign:
        raise ConfigError(
            f"optimizer's parameters are not the module's trainable parameters: {len(missing)} "
            f"trainable parameter(s) missing from the optimizer ({missing[:5]}) and {foreign} "
            "optimizer parameter(s) that are not the module's. Build the optimizer from "
            "model.parameters() of the same model before make_private.")


def _check_flag(name: str, value: Any) -> bool:
    """`value` when it is a bool; ConfigError naming the argument otherwise."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False.")
    return value


class PrivacyEngine:
    """Makes a model, optimizer and loader private and keeps the privacy accountant.

    Args:
        accountant: "prv" (tight, default), "rdp" or "gdp", or an accountant object.
        secure_mode: draw noise and sampling from the OS CSPRNG (see dptrain.randomness);
            runs are then not reproducible.
        seed: seed of the noise and Poisson sampling generators, used only with
            `reproducible_mechanism=True` (default: drawn from torch's global RNG, so
            torch.manual_seed makes such a run repeat).
        reproducible_mechanism: draw the gradient noise AND the Poisson sampling coins from
            generators seeded from `seed`, so that a run repeats bit for bit. An explicit opt-in,
            NOT a guarantee if the seed is known: whoever knows it can rebuild the noise and
            subtract it from the model, and knows which examples each batch held (amplification
            by subsampling, which the accountant counts on, assumes that is secret). Default
            False: both generators are seeded from OS entropy, independent of `seed` and of
            torch's global RNG, and their states are never saved (`state_dict` leaves them out).
    """

    def __init__(self, accountant: Any = "prv", secure_mode: bool = False,
                 seed: int | None = None, reproducible_mechanism: bool = False) -> None:
        reproducible = _check_flag("reproducible_mechanism", reproducible_mechanism)
        if reproducible and secure_mode:
            raise ConfigError("reproducible_mechanism=True cannot be combined with "
                              "secure_mode=True (privacy.reproducible_mechanism, "
                              "privacy.secure_mode): secure mode draws all noise and sampling "
                              "from the OS CSPRNG. Drop one of the two.")
        self.accountant = _make_accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self.reproducible_mechanism = reproducible
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = int(seed)
        noise_seed, sampling_seed = derive_seeds(self.seed, 2)
        self._noise_seed = noise_seed
        # Otherwise the DP optimizer and the Poisson sampler seed their own generators from OS
        # entropy (and the sampler's is broadcast from rank 0 under DDP).
        self.noise_generator = make_generator(noise_seed) if reproducible else None
        self.sampling_generator = make_generator(sampling_seed) if reproducible else None
        self.optimizer: DPOptimizer | None = None
        self.data_loader: Any = None
        self.dataset_size: int | None = None
        self.poisson_sampling = True
        self.plan: PrivacyPlan | None = None            # set by make_private
        self.performance: PerformanceSettings | None = None
        self.privacy_unit = "example"  # "user" after make_private(privacy_unit="user")

    # -- making things private ---------------------------------------------------------------
    def plan_of(self, data_loader: DataLoader, *, noise_multiplier: float | None = None,
                max_grad_norm: float | list[float] = 1.0, poisson_sampling: bool = True,
                sampling: str | None = None, clipping: str = "flat",
                noise_schedule: ScheduleSpec = None, sample_rate_schedule: ScheduleSpec = None,
                target_unclipped_quantile: float = 0.5, clipbound_learning_rate: float = 0.2,
                count_noise_std: float | None = None, target_epsilon: float | None = None,
                target_delta: float | None = None,
                noise_generator: torch.Generator | None = None, privacy_unit: str = "example",
                user_ids: Any = None, max_examples_per_user: int | None = None,
                sampling_groups: int | None = None,
                noise_strategy: NoiseStrategy | None = None) -> PrivacyPlan:
        """The plan make_private's keyword arguments describe (q = the loader's batch_size / N,
        N the examples, or the users with privacy_unit="user"; `sampling` "poisson" |
        "shuffle" | "cyclic_poisson" (with `sampling_groups` groups; banded and BLT noise alone
        pick it, dptrain.privacy.plan.selection_for) | "given_shuffle" (the caller's loader
        kept and charged as shuffled batches, for a loader dptrain.data.given_shuffle accepts;
        q makes one pass an epoch); poisson_sampling=False without it: the
        caller's own loader, accounted as Poisson, no guarantee; `noise_strategy` a
        dptrain.privacy.noise strategy, None: independent)."""
        unit = Unit(privacy_unit, max_examples_per_user=max_examples_per_user)
        _, rate = unit.population(data_loader, user_ids, self._loader_rate)
        if sampling is None and not poisson_sampling:
            sampling = Given.kind
        if sampling == GivenShuffle.kind:  # one pass of the caller's loader is an epoch
            rate = given_shuffle_rate(data_loader)
        sigma = check_noise_multiplier(noise_multiplier) if noise_multiplier is not None else None
        norm = check_max_grad_norm(max_grad_norm, per_layer=clipping == "per_layer")
        noise = Noise(multiplier=sigma, target_epsilon=target_epsilon,
                      schedule=schedule_spec(noise_schedule),
                      strategy=strategy_from_dict(noise_strategy))
        return PrivacyPlan(
            selection=selection_for(noise, rate, sampling, sampling_groups,
                                    schedule_spec(sample_rate_schedule)),
            clipping=Clipping(max_grad_norm=tuple(norm) if isinstance(norm, list) else norm,
                              kind=clipping, target_unclipped_quantile=target_unclipped_quantile,
                              clipbound_learning_rate=clipbound_learning_rate,
                              count_noise_std=count_noise_std),
            noise=noise, accountant=self.accountant.name, delta=target_delta,
            randomness=self._planned_randomness(noise_generator), unit=unit)

    def make_private(self, *, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader,
                     noise_multiplier: float | None = None,
                     max_grad_norm: float | list[float] = Default(1.0),
                     plan: PrivacyPlan | None = None,
                     performance: PerformanceSettings | None = None,
                     poisson_sampling: bool = Default(True), sampling: str | None = None,
                     clipping: str = Default("flat"),
                     noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = Default("hooks"), noise_schedule: ScheduleSpec = None,
                     sample_rate_schedule: ScheduleSpec = None, allow_non_poisson: bool = False,
                     batch_first: bool = True, loss_reduction: str = "mean",
                     target_unclipped_quantile: float = Default(0.5),
                     clipbound_learning_rate: float = Default(0.2),
                     count_noise_std: float | None = None, privacy_unit: str = Default("example"),
                     user_ids: Any = None, max_examples_per_user: int | None = None,
                     sampling_groups: int | None = None,
                     noise_strategy: NoiseStrategy | None = None
                     ) -> tuple[Any, DPOptimizer, Any]:
        """The private (module, optimizer, data_loader) of `plan`; see docs/python-api.md.

        Without `plan`, the keyword arguments describe it (`plan_of`); with one, every keyword
        that describes a plan (noise_multiplier, max_grad_norm, clipping and its parameters,
        poisson_sampling, sampling, sampling_groups, the schedules, privacy_unit,
        max_examples_per_user, noise_strategy) may be given only when it agrees with the plan
        (ConfigError naming it otherwise; a Python schedule the plan names is taken from the
        keyword). `performance` (default: `grad_sample_mode`) says how it is computed. `noise_generator`: a seeded generator for
        the noise, an opt-in to reproducible noise (not a guarantee if its seed is known;
        `randomness()` then says "reproducible"); the engine's `reproducible_mechanism` seeds the
        noise and the sampling from `seed`. User-level DP (privacy_unit="user",
        dptrain.privacy.user_level): `user_ids` holds one user id per example of the loader's
        dataset; users are Poisson-sampled at q = batch_size / N_users, each contributes at most
        `max_examples_per_user` examples (None: all) and its mean gradient is clipped to
        max_grad_norm. `noise_strategy` (dptrain.privacy.noise; None: independent DP-SGD noise)
        correlates the noise across steps; its steps are charged by the plan's AccountingEvent
        (dptrain.accounting.events: amplified banded MF, or the unamplified sensitivity), never
        as DP-SGD. Raises PrivacyError / ConfigError naming the argument for any
        unusable value.
        """
        described = dict(
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            poisson_sampling=poisson_sampling, sampling=sampling, clipping=clipping,
            noise_schedule=noise_schedule, sample_rate_schedule=sample_rate_schedule,
            target_unclipped_quantile=target_unclipped_quantile,
            clipbound_learning_rate=clipbound_learning_rate, count_noise_std=count_noise_std,
            privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
            sampling_groups=sampling_groups, noise_strategy=noise_strategy)
        if plan is None:
            if noise_multiplier is None:
                raise PrivacyError("noise_multiplier is missing: pass noise_multiplier=1.0 (or a "
                                   "plan, or use make_private_with_epsilon).")
            plan = self.plan_of(data_loader, noise_generator=noise_generator, user_ids=user_ids,
                                **{k: given_value(v) for k, v in described.items()})
        else:  # what is given beside a plan must agree with it (the plan is what is recorded)
            plan = beside_plan(plan, {k: v for k, v in described.items() if is_given(v)})
        mode = given_value(grad_sample_mode)
        if performance is None:
            performance = PerformanceSettings(grad_sample_mode=mode)
        elif is_given(grad_sample_mode) and mode != performance.grad_sample_mode:
            raise ConfigError(f"grad_sample_mode={mode!r} differs from performance="
                              f"{performance!r}: give the mode in `performance` alone.")
        return self._build(plan, performance, module, optimizer, data_loader, noise_generator,
                           allow_non_poisson, batch_first, loss_reduction,
                           (noise_schedule, sample_rate_schedule), user_ids)

    def _build(self, plan: PrivacyPlan, performance: PerformanceSettings, module: nn.Module,
               optimizer: Optimizer, data_loader: DataLoader,
               noise_generator: torch.Generator | None, allow_non_poisson: bool,
               batch_first: bool, loss_reduction: str,
               schedules: tuple[ScheduleSpec, ScheduleSpec],
               user_ids: Any = None) -> tuple[Any, DPOptimizer, Any]:
        """The mechanism of `plan`: wrapped module, DP optimizer, private loader (`user_ids`:
        one user id per example, for a user-level plan)."""
        self._check_plan(plan, noise_generator)
        module, distributed = unwrap_ddp(module)  # a DDP model: its inner module
        sharded = is_fully_sharded(module)  # FSDP2: dptrain/distributed/fsdp.py
        distributed = distributed or sharded
        plan.unit.check_data(user_ids, distributed)
        context = LoaderContext(generator=self.sampling_generator, secure=self.secure_mode,
                                allow_non_poisson=allow_non_poisson, distributed=distributed,
                                sharded=sharded)
        if distributed:
            plan.selection.check_distributed(context)
        num_samples, _ = plan.unit.population(data_loader, user_ids, self._loader_rate)  # N units
        plan = plan.with_dataset(num_samples)
        sigma, sample_rate = plan.noise.multiplier, plan.selection.sample_rate
        noise_sched = as_schedule(schedules[0] if schedules[0] is not None
                                  else _as_spec(plan.noise.schedule), sigma, "noise_schedule")
        rate_sched = as_schedule(schedules[1] if schedules[1] is not None
                                 else _as_spec(plan.selection.schedule), sample_rate,
                                 "sample_rate_schedule")
        source = _wrap_module(module, performance.grad_sample_mode, batch_first, loss_reduction,
                              sharded)
        try:
            named = _trainable_parameters(source)
            _check_optimizer_params(optimizer, source, named)
            expected_batch_size = plan.expected_batch_size(num_samples)
            clip = plan.clipping
            clipper = make_clipper(clip.kind, list(clip.max_grad_norm)
                                   if isinstance(clip.max_grad_norm, tuple) else clip.max_grad_norm,
                                   [p for _, p in named], expected_batch_size=expected_batch_size,
                                   target_unclipped_quantile=clip.target_unclipped_quantile,
                                   clipbound_learning_rate=clip.clipbound_learning_rate,
                                   count_noise_std=clip.count_noise_std)
            clipper.gradient_noise_multiplier(sigma)  # adaptive: fails now if sigma_b is too small
            self._place_noise_generator([p for _, p in named])
            self.poisson_sampling = plan.selection.poisson
            # the unit's loader: the selection's over examples, or one over users
            private_loader = plan.unit.private_loader(
                plan.selection, data_loader, user_ids,
                dataclasses.replace(context, rate_schedule=rate_sched))
            self._check_epochs_aligned(private_loader)  # a shuffled pass starts an epoch
            # what is clipped to C: each example's gradient, or each sampled user's mean
            clipper = plan.unit.clipper(clipper, [p for _, p in named], private_loader, source)
            dp_optimizer = optimizer_class(distributed, sharded)(
                optimizer, sigma, None, expected_batch_size, clipper, module=source,
                sample_rate=sample_rate,
                noise_generator=noise_generator or self.noise_generator,
                secure_mode=self.secure_mode, noise_schedule=noise_sched,
                noise_strategy=plan.noise.strategy)
        except BaseException:
            if source is not module:  # a wrapper made here: leave the user's model as it was
                source.remove_hooks()
            raise
        if callable(getattr(private_loader, "add_hand_out_listener", None)):
            dp_optimizer.follow_loader(
                private_loader, one_batch_per_step=plan.selection.steps_follow_batches)
        dp_optimizer.add_charge_listener(self._account_charge)
        self.accountant = accountant_for(self.accountant, plan.accounting)
        self.optimizer, self.data_loader, self.dataset_size = dp_optimizer, private_loader, num_samples
        self.plan, self.performance = plan, performance
        self.privacy_unit = plan.unit.kind
        return source, dp_optimizer, private_loader

    def _check_plan(self, plan: PrivacyPlan, noise_generator: torch.Generator | None) -> None:
        """ConfigError when `plan` asks for another accountant or randomness than this engine's."""
        if noise_generator is not None and self.secure_mode:
            raise ConfigError("noise_generator cannot be used with secure_mode=True: secure mode "
                              "draws all noise from the OS CSPRNG. Drop one of the two.")
        if plan.noise.multiplier is None:
            raise PrivacyError("the plan's noise multiplier is not set: calibrate it "
                               "(make_private_with_epsilon) or give noise_multiplier.")
        engine = {"accountant": self.accountant.name,
                  "randomness": self._planned_randomness(noise_generator)}
        for key, value in engine.items():
            if getattr(plan, key) != value:
                raise ConfigError(f"the plan's {key}={getattr(plan, key)!r} is not this engine's "
                                  f"({value!r}): build the engine with PrivacyEngine.for_plan(plan).")

    def _planned_randomness(self, noise_generator: torch.Generator | None) -> str:
        """The plan's randomness for this engine (and a caller's noise generator)."""
        if self.secure_mode:
            return "secure"
        return "reproducible" if self.reproducible_mechanism or noise_generator else "os_entropy"

    @classmethod
    def for_plan(cls, plan: PrivacyPlan, seed: int | None = None) -> PrivacyEngine:
        """The engine (accountant, randomness) `plan` names."""
        return cls(accountant=plan.accountant, secure_mode=plan.secure, seed=seed,
                   reproducible_mechanism=plan.reproducible)

    def make_private_with_epsilon(self, *, target_epsilon: float, target_delta: float,
                                  epochs: float, data_loader: DataLoader,
                                  epsilon_tolerance: float = 0.01,
                                  **kwargs: Any) -> tuple[Any, DPOptimizer, Any]:
        """make_private with the noise multiplier calibrated so that `epochs` epochs spend
        `target_epsilon` at `target_delta` (the accountant's method). Other arguments as
        make_private (noise_multiplier and the schedules excluded)."""
        for name in ("noise_multiplier", "noise_schedule", "sample_rate_schedule"):
            if kwargs.get(name) is not None:
                raise ConfigError(f"make_private_with_epsilon calibrates a constant noise multiplier "
                                  f"for a constant sample rate: do not pass {name}; use make_private "
                                  "with a given sigma (and check the budget with get_epsilon).")
            kwargs.pop(name, None)
        check_epsilon(target_epsilon, "target_epsilon", target=True)
        if not (isinstance(epochs, (int, float)) and epochs > 0):
            raise ConfigError(f"epochs={epochs!r} must be > 0 (the training length the budget covers).")
        plan_args = {k: kwargs.pop(k) for k in _PLAN_ARGUMENTS if k in kwargs}
        plan = self.plan_of(data_loader, target_epsilon=target_epsilon, target_delta=target_delta,
                            noise_generator=kwargs.get("noise_generator"),
                            user_ids=kwargs.get("user_ids"), **plan_args)
        num_samples, _ = plan.unit.population(data_loader, kwargs.get("user_ids"),
                                              self._loader_rate)
        warn_if_delta_too_large(target_delta, num_samples, "target_delta")
        return self.make_private(data_loader=data_loader,
                                 plan=calibrated(plan, epochs, epsilon_tolerance), **kwargs)

    # -- accounting ----------------------------------------------------------------------------
    def _account_charge(self, charge: Charge) -> None:
        """Charge listener: the accountant records what the step charged (sigma, and the q of
        the released batch's record), from the charge alone."""
        self.accountant.step_charge(charge)

    def upcoming_sample_rates(self, count: int) -> list[float]:
        """q of each of the next `count` steps when each releases the next batch of the private
        loader: its sampler's `upcoming_rates` (the one evaluator of q by batch), else the
        plan's q (a caller's own loader)."""
        sampler = getattr(self.data_loader, "poisson_sampler", None)
        if sampler is not None:
            return sampler.upcoming_rates(count)
        return [float(self.plan.selection.sample_rate)] * count

    def sample_rate_at(self, step: int) -> float:
        """q of logical step `step` (0-based) when every batch is stepped on: the plan's
        selection schedule as the private loader's sampler (its one evaluator) draws batch
        `step` with it, else the sampler's q (a caller's own loader: the plan's q)."""
        sampler = getattr(self.data_loader, "poisson_sampler", None)
        if sampler is not None:
            return sampler.rate_at(step)
        return float(self.plan.selection.sample_rate)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at `delta` (warns when the loader is not Poisson-sampled, and when
        the noise or the sampling is reproducible from a seed)."""
        warn_if_delta_too_large(delta, self.dataset_size, "delta")
        if self.plan is not None and not self.plan.selection.proven:
            warnings.warn(self.plan.selection.warning, UserWarning, stacklevel=2)
        if self.randomness() == "reproducible":
            warnings.warn("The mechanism is reproducible from a seed (reproducible_mechanism=True "
                          "or a noise_generator): the epsilon is NOT a guarantee if the seed is "
                          "known, since the noise can then be rebuilt and removed and the "
                          "batches' members are known.", UserWarning, stacklevel=2)
        return float(self.accountant.get_epsilon(delta=delta))

    def randomness(self) -> str:
        """How the mechanism's random draws are seeded (the ledger's mechanism.randomness):
        "secure" (every draw from the OS CSPRNG), "reproducible" (the noise or the Poisson coins
        from a known seed: `reproducible_mechanism=True` or a `noise_generator`) or "os_entropy"
        (the default: generators seeded from OS entropy)."""
        if self.secure_mode:
            return "secure"
        noise, coins = self._reproducible_parts()
        return "reproducible" if noise or coins else "os_entropy"

    def mechanism_replays(self) -> bool:
        """Whether restoring `state_dict()` makes the next steps draw exactly the noise and the
        batches they drew the first time: both generators seeded by the caller (a non-Poisson
        loader's own order is the caller's business). Never with OS entropy or secure mode."""
        noise, coins = self._reproducible_parts()
        return bool(not self.secure_mode and noise and coins is not False)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Accountant, generator states and the optimizer's DP state, for exact resume.

        The noise generator's and the sampler's generator states are included only when they
        are reproducible (a seed is known anyway); generators seeded from OS entropy are left
        out, and in secure mode none exists (nothing to save, nothing to replay).
        """
        opt = self.optimizer
        sampler = getattr(self.data_loader, "poisson_sampler", None)
        noise_gen = self._saved_noise_generator()
        return {
            "accountant": self.accountant.state_dict(),
            "seed": self.seed,
            "secure_mode": self.secure_mode,
            "noise_generator": None if noise_gen is None else noise_gen.get_state(),
            "sampler": None if sampler is None else sampler.state_dict(),
            "optimizer": None if opt is None else opt.dp_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (call after make_private for the full state).

        PrivacyError, the engine left as it was, when the saved history and the saved sampler
        would not keep a shuffled loader's passes on the accountant's epochs
        (`load_accountant_state`), or when a shuffle stopped mid-epoch cannot be continued
        (its shuffle was not saved: dptrain.data.sampling.ShuffleBatchSampler)."""
        sampler = getattr(self.data_loader, "poisson_sampler", None)
        saved_sampler = state.get("sampler") if sampler is not None else None
        self.load_accountant_state(state["accountant"], saved_sampler)
        opt = self.optimizer
        noise_gen = self._saved_noise_generator()
        if noise_gen is not None and state.get("noise_generator") is not None:
            noise_gen.set_state(state["noise_generator"])
        if opt is not None and state.get("optimizer") is not None:
            opt.load_dp_state_dict(state["optimizer"])

    def load_accountant_state(self, state: Mapping[str, Any],
                              sampler_state: Mapping[str, Any] | None = None) -> None:
        """Load the accountant's `state` (and the private loader's sampler's `sampler_state`,
        if given); PrivacyError (both left as they were) when the accountant's epochs would no
        longer start where a loader charged as a shuffle (dptrain's, or a caller's kept one)
        starts a pass, or the sampler refuses its state."""
        previous = self.accountant.state_dict()
        self.accountant.load_state_dict(state)
        try:
            self._check_epochs_aligned(sampler_state=sampler_state)
            if sampler_state is not None:
                self.data_loader.poisson_sampler.load_state_dict(sampler_state)
        except Exception:
            self.accountant.load_state_dict(previous)
            raise

    def _check_epochs_aligned(self, loader: Any = None,
                              sampler_state: Mapping[str, Any] | None = None) -> None:
        """PrivacyError when the accountant's history and the place of a loader charged as a
        shuffle (dptrain's ShuffleDataLoader, or a caller's kept GivenShuffleLoader; default:
        the engine's) in its pass disagree; with `sampler_state`, the place that state would
        restore. Nothing to check for other loaders."""
        loader = self.data_loader if loader is None else loader
        check = getattr(loader, "check_aligned", None)
        if not callable(check):
            return
        if sampler_state is None:
            check(len(self.accountant))
        else:
            check(len(self.accountant), loader.poisson_sampler.saved_position(sampler_state))

    # -- helpers -------------------------------------------------------------------------------
    def _reproducible_parts(self) -> tuple[bool, bool | None]:
        """(noise, coins): whether the noise and the Poisson sampling coins come from seeded
        generators (before make_private: as asked; coins None for a non-Poisson loader)."""
        if self.optimizer is None:
            return self.reproducible_mechanism, self.reproducible_mechanism
        sampler = getattr(self.data_loader, "poisson_sampler", None)
        coins = None if sampler is None else bool(sampler.reproducible)
        return bool(self.optimizer.reproducible_noise), coins

    def _saved_noise_generator(self) -> torch.Generator | None:
        """The noise generator whose state `state_dict` carries: only a reproducible one (a
        generator seeded from OS entropy must stay unknown, so its state is never written)."""
        opt = self.optimizer
        if opt is None:
            return self.noise_generator
        return opt.noise_generator if opt.reproducible_noise else None

    def _place_noise_generator(self, params: list[nn.Parameter]) -> None:
        """Move the engine's (still unused) reproducible noise generator to the parameters'
        device, so noise is drawn where it is added (same seed, so CPU runs are unchanged)."""
        if self.noise_generator is None or not params:
            return
        device = params[0].device
        if self.noise_generator.device != device:
            self.noise_generator = make_generator(self._noise_seed, device=device)

    @staticmethod
    def _loader_rate(data_loader: DataLoader) -> tuple[int, float]:
        """(N, q) of a loader: q = batch_size / N, validated to lie in (0, 1]."""
        num_samples = dataset_size(data_loader)
        rate = default_sample_rate(data_loader, num_samples)
        if not 0 < rate <= 1:
            raise PrivacyError(f"data_loader gives a sample rate of {rate:.4g} (batch_size / N with "
                               f"N = {num_samples}); it must be in (0, 1]: use a batch_size between "
                               f"1 and {num_samples}.")
        return num_samples, check_sample_rate(rate, "data_loader sample rate")


class PrivateTraining(NamedTuple):
    """What `dptrain.make_private` returns."""

    module: Any
    optimizer: DPOptimizer
    data_loader: Any
    engine: PrivacyEngine


def make_private(*, accountant: Any = "prv", secure_mode: bool = False, seed: int | None = None,
                 reproducible_mechanism: bool = False, **kwargs: Any) -> PrivateTraining:
    """One call: a new PrivacyEngine(accountant, secure_mode, seed, reproducible_mechanism) and
    its make_private(**kwargs).

    Returns (module, optimizer, data_loader, engine); engine.get_epsilon(delta) reports epsilon.
    """
    engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode, seed=seed,
                           reproducible_mechanism=reproducible_mechanism)
    module, optimizer, data_loader = engine.make_private(**kwargs)
    return PrivateTraining(module, optimizer, data_loader, engine)
