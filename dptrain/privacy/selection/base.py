"""The batch-selection strategy: what every selection scheme owns, and the registry of schemes.

A `Selection` is a frozen part of the privacy plan that *is* its strategy: `Selection(
sample_rate=q, kind="shuffle")` builds the registered `Shuffle` object, and every behaviour the
engine, the ledger, resume and the planner need is asked of it, never switched on its kind:

    index stream     private_loader(data_loader, context): the loader that draws its batches
    accounting       accounting: the AccountingEvent its steps are charged as (with the noise:
                     PrivacyPlan.accounting); relation: the neighbouring relation it supports
    rules            check_plan(plan): what it refuses beside it (clipping, noise); the unit
                     asks supports_user_level (dptrain.privacy.unit)
    defaults         steps_per_epoch; min_separation (what correlated noise is optimised for)
    resume           steps_follow_batches (step t must release batch t); epoch_bound (an
                     example at most once per epoch: a resume must start at an epoch boundary
                     unless its sampler state carries the epoch)
    ledger           description (the ledger's `sampling`), ledger_notes / carry_ledger_notes

The plan records `kind`, `sample_rate`, `schedule` and `groups` (`to_dict`, unchanged since the
plan's version 1, so old ledgers read back to the same strategies). A new scheme is one module
(its sampler, its strategy class, its accounting entry in dptrain.accounting.selections) and one
`register_selection` line in dptrain/privacy/selection/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from dptrain.accounting.events import SUBSTITUTION, AccountingEvent
from dptrain.accounting.history import steps_per_epoch
from dptrain.checks import check_sample_rate
from dptrain.data.sharding import shard_loader
from dptrain.errors import ConfigError
from dptrain.privacy.strategies import Registry, registered_instance

if TYPE_CHECKING:  # annotations only: the plan imports this module
    from dptrain.privacy.plan import PrivacyPlan

_SELECTIONS = Registry("batch selection", "privacy.sampling")


def register_selection(cls: type["Selection"]) -> type["Selection"]:
    """Register a selection strategy class under its `kind` (the plan's and the config's name)."""
    return _SELECTIONS.register(cls)


def selection_kinds(command: bool = False) -> tuple[str, ...]:
    """The registered selection kinds (`command`: only those the command line may build)."""
    return tuple(k for k in _SELECTIONS.kinds() if _SELECTIONS.classes[k].command or not command)


def selection_class(kind: Any, key: str = "privacy.sampling") -> type["Selection"]:
    """The strategy class registered as `kind`; ConfigError naming `key` and the known kinds."""
    return _SELECTIONS.lookup(kind, key)


def correlated(strategy: Any) -> bool:
    """Whether a noise strategy's noise differs from independent noise (its column is not
    (1, 0, ...)): the rule of dptrain.accounting.events."""
    return AccountingEvent(strategy=strategy).correlated


def noise_bands(strategy: Any) -> int | None:
    """b of a banded noise strategy (each example may then take part at most once every b steps
    for the amplified accounting); None for other noise."""
    bands = getattr(strategy, "bands", None)
    return None if bands is None else int(bands)


@dataclass(frozen=True)
class LoaderContext:
    """What building a selection's loader needs beside the caller's loader: the sampling
    generator (None: seeded from OS entropy), secure mode, the sample-rate schedule (Poisson
    only), whether the caller allowed a non-Poisson loader, and the model's distribution
    (`distributed`: DDP or FSDP2; `sharded`: FSDP2)."""

    generator: torch.Generator | None = None
    secure: bool = False
    rate_schedule: Any = None
    allow_non_poisson: bool = False
    distributed: bool = False
    sharded: bool = False

    def shard(self, loader: Any, data_loader: Any) -> Any:
        """`loader` (built over `data_loader`'s whole dataset), yielding this rank's share of
        every batch when the model is distributed (`dptrain.data.sharding.shard_loader`, a
        collective: the one rank-sharding rule of every selection), else unchanged."""
        return shard_loader(loader, data_loader) if self.distributed else loader


@dataclass(frozen=True)
class Selection:
    """Batch selection at sample rate q (`sample_rate`): each example's expected number of
    batches per step. `kind` picks the registered strategy (see the module docstring); the
    base class's behaviour is the default every strategy may override."""

    sample_rate: float
    kind: str = "poisson"
    schedule: Mapping[str, Any] | None = None
    groups: int = 1

    #: the command line may build it (privacy.sampling); False: make_private's keywords only
    command: ClassVar[bool] = True
    #: plain Poisson sampling (PrivacyEngine.poisson_sampling, Opacus's attribute)
    poisson: ClassVar[bool] = False
    #: amplification by subsampling applies (the ledger's `amplified`, before the noise column)
    amplified: ClassVar[bool] = False
    #: epsilon is a proven bound for it (False: the caller's own loader charged as Poisson)
    proven: ClassVar[bool] = True
    #: q may vary by step (privacy.sample_rate_schedule)
    takes_schedule: ClassVar[bool] = False
    #: split into more than one group (privacy.sampling_groups)
    takes_groups: ClassVar[bool] = False
    #: step t must release exactly batch t of its loader (groups, epochs)
    steps_follow_batches: ClassVar[bool] = False
    #: every example is in at most one batch of each epoch of steps_per_epoch steps
    epoch_bound: ClassVar[bool] = False
    #: privacy.unit=user may sample users with it (dptrain.privacy.unit.user asks)
    supports_user_level: ClassVar[bool] = False
    #: clipping=adaptive may be used (its count is accounted as a Poisson-sampled query)
    supports_adaptive_clipping: ClassVar[bool] = False
    #: the name of its entry in dptrain.accounting.selections
    accounting_kind: ClassVar[str] = "poisson"
    #: the ledger's `sampling`, when not its kind
    ledger_words: ClassVar[str | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "Selection":
        """The registered strategy of `kind` (given or its class's default): Selection(q,
        kind="shuffle") is a Shuffle; dataclasses.replace(..., kind=...) changes the class."""
        kind = kwargs.get("kind", args[1] if len(args) > 1 else None)
        return registered_instance(cls, Selection, kind, "poisson", selection_class, args, kwargs)

    def __post_init__(self) -> None:
        selection_class(self.kind)
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        if self.schedule is not None and not self.takes_schedule:
            raise ConfigError(f"a sample_rate_schedule needs privacy.sampling=poisson: {self.kind} "
                              "batches keep one sample rate for the whole run. Drop the schedule.")
        if self.groups != 1 and not self.takes_groups:
            raise ConfigError(f"privacy.sampling_groups={self.groups} splits the data for cyclic "
                              f"Poisson sampling, not for privacy.sampling={self.kind}: set "
                              "privacy.sampling=cyclic_poisson, or drop privacy.sampling_groups.")

    # -- what it is -------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Steps in one epoch: ceil(1 / q) (the sampler's, the trainer's and the planner's)."""
        return steps_per_epoch(self.sample_rate)

    @property
    def min_separation(self) -> int:
        """The steps between two participations of one example that a correlated noise strategy
        is optimised for (1: none guaranteed)."""
        return 1

    @property
    def shuffled(self) -> bool:
        """Charged as shuffled batches (substitution, no amplification): the words of the
        ledger's privacy unit follow the relation."""
        return self.relation == SUBSTITUTION

    @property
    def accounting(self) -> AccountingEvent:
        """How its steps are charged with independent noise (dptrain.accounting.events);
        `PrivacyPlan.accounting` adds the noise strategy."""
        return AccountingEvent(self.accounting_kind, self.groups)

    @property
    def relation(self) -> str:
        """The neighbouring relation its epsilon is stated for ("add/remove" | "substitution")."""
        return self.accounting.relation

    @property
    def description(self) -> str:
        """The ledger's `mechanism.sampling`."""
        return self.ledger_words or self.kind

    def parameters(self) -> dict[str, Any]:
        """What the planner and the ledger show of it: {"sampling": kind, ...its parameters}."""
        return {"sampling": self.kind}

    # -- rules --------------------------------------------------------------------------------
    def check_plan(self, plan: "PrivacyPlan") -> None:
        """ConfigError when the rest of `plan` cannot run or be accounted with this selection:
        adaptive clipping, and the noise (`check_noise`); the privacy unit checks it
        (`Unit.check_selection`, reading `supports_user_level`)."""
        if plan.clipping.kind == "adaptive" and not self.supports_adaptive_clipping:
            raise ConfigError("clipping=adaptive needs sampling=poisson: its clipped count is "
                              "accounted as a Poisson-sampled query. Use clipping=flat or "
                              f"per_layer with {self.kind} batches.")
        self.check_noise(plan.noise.strategy)

    def check_noise(self, strategy: Any) -> None:
        """ConfigError when the noise `strategy` cannot be accounted with it (default: only
        independent noise, as no participation schema is known)."""
        if correlated(strategy):
            raise ConfigError(
                f"privacy.noise={strategy.name} (correlated noise) cannot be accounted with "
                f"privacy.sampling={self.kind}: no participation schema is known for it. Use "
                "privacy.noise=independent, or sampling 'poisson', 'cyclic_poisson' or "
                "'shuffle'.")

    # -- the index stream ---------------------------------------------------------------------
    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        """The loader drawing its batches over `data_loader`'s dataset (workers, collate kept)."""
        raise NotImplementedError

    def check_distributed(self, context: LoaderContext) -> None:
        """ConfigError when it cannot run over several ranks (default: it can)."""

    # -- the ledger -----------------------------------------------------------------------------
    def ledger_notes(self) -> dict[str, Any]:
        """Extra entries of the ledger's mechanism (e.g. why its relation holds)."""
        return {}

    def carry_ledger_notes(self, previous: Mapping[str, Any] | None,
                           mechanism: dict[str, Any]) -> None:
        """On resume: carry what an earlier process's ledger entry (`previous`) says about the
        steps it already released into `mechanism` (default: nothing)."""


__all__ = ["LoaderContext", "Selection", "correlated", "noise_bands", "register_selection", "selection_class",
           "selection_kinds"]
