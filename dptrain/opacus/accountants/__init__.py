"""Opacus's accountants (``opacus.accountants``): dptrain's accountants with Opacus's
``mechanism()``, assignable ``history``, state_dict keys {"history", "mechanism"},
``get_privacy_spent`` and ``create_accountant``. RDPAccountant keeps Opacus's default orders."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Mapping

# under private names: Opacus's submodules of this package (accountants.rdp, .gdp, .prv), once
# imported, become attributes of the package and would shadow the engine's modules here
from dptrain.accounting import gdp as _gdp, prv as _prv, rdp as _rdp, shuffle as _shuffle
from dptrain.accounting.base import Accountant, normalize_history
from dptrain.errors import PrivacyError


class _OpacusAccountant:
    """Mixin: the Opacus accountant interface over a dptrain Accountant."""

    name: str

    @classmethod
    def mechanism(cls) -> str:
        return cls.name

    @property
    def history(self) -> list[tuple[float, float, int]]:  # type: ignore[override]
        return list(self._history)

    @history.setter
    def history(self, value: Any) -> None:
        self._history = normalize_history(value)

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """A DPOptimizer step hook that records each step at `sample_rate` and the optimizer's
        current noise multiplier (attach it with optimizer.attach_step_hook)."""
        def hook_fn(optimizer: Any) -> None:
            self.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)
        return hook_fn

    def state_dict(self, destination: dict | None = None) -> dict:  # type: ignore[override]
        destination = OrderedDict() if destination is None else destination
        destination["history"] = self.history
        destination["mechanism"] = self.mechanism()
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        if not state_dict:
            raise ValueError("state dict is either None or empty and hence cannot be loaded "
                             "into Privacy Accountant.")
        for key in ("history", "mechanism"):
            if key not in state_dict:
                raise ValueError(f"state_dict does not have the key `{key}`.")
        if state_dict["mechanism"] != self.mechanism():
            _refuse_mechanism(state_dict["mechanism"], self.mechanism())
        self._history = normalize_history(state_dict["history"])


def _refuse_mechanism(saved: str, mine: str) -> None:
    """Raise for a state_dict of the `saved` mechanism loaded into a `mine` accountant: a
    PrivacyError when one of them charges shuffled batches (a shuffle's history charged as
    Poisson sampling would under-report its epsilon, and the reverse would not be Opacus's
    epsilon), Opacus's ValueError otherwise."""
    if ShuffleAccountant.MECHANISM not in (saved, mine):
        raise ValueError(f"state_dict of a {saved!r} accountant cannot be loaded into a {mine!r} "
                         "accountant.")
    kinds = {name: "shuffled batches (poisson_sampling=False, no amplification)"
             if name == ShuffleAccountant.MECHANISM else f"Poisson-sampled batches ({name!r})"
             for name in (saved, mine)}
    raise PrivacyError(
        f"the saved accountant charged {kinds[saved]}, but this one charges {kinds[mine]}: its "
        "history cannot be loaded here, since its steps would then be charged as the other "
        "kind of batches (a shuffle's charged as Poisson would under-report epsilon). Call "
        "make_private with the poisson_sampling of the run that saved it (and the same "
        "DataLoader) before load_checkpoint / load_state_dict.")


class RDPAccountant(_OpacusAccountant, _rdp.RDPAccountant):
    """Opacus's RDP accountant: its default orders, get_epsilon(delta, alphas=None)."""

    DEFAULT_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))

    def __init__(self) -> None:
        super().__init__(orders=self.DEFAULT_ALPHAS)

    def get_privacy_spent(self, *, delta: float, alphas: list[float] | None = None
                          ) -> tuple[float, float]:
        """(epsilon, best order) at `delta` over `alphas` (default: DEFAULT_ALPHAS)."""
        other = _rdp.RDPAccountant(orders=alphas or self.DEFAULT_ALPHAS)
        other._history = self._history
        if not self._history:
            return 0.0, float("nan")
        return other.get_epsilon_and_order(delta)

    def get_epsilon(self, delta: float, alphas: list[float] | None = None,  # type: ignore[override]
                    **kwargs: Any) -> float:
        return self.get_privacy_spent(delta=delta, alphas=alphas)[0]


class PRVAccountant(_OpacusAccountant, _prv.PRVAccountant):
    """Opacus's PRV accountant: get_epsilon(delta, *, eps_error=0.01)."""

    def get_epsilon(self, delta: float, *, eps_error: float = 0.01,  # type: ignore[override]
                    **kwargs: Any) -> float:
        self.eps_error = eps_error
        return super().get_epsilon(delta)


class GaussianAccountant(_OpacusAccountant, _gdp.GaussianAccountant):
    """Opacus's GDP accountant (CLT approximation)."""

    def get_epsilon(self, delta: float, poisson: bool = True,  # type: ignore[override]
                    **kwargs: Any) -> float:
        return super().get_epsilon(delta)


class ShuffleAccountant(_OpacusAccountant, _shuffle.ShuffleAccountant):
    """The accountant after make_private(poisson_sampling=False), which Opacus does not have:
    each epoch one Gaussian release of every example, no amplification, substitution adjacency
    (dptrain.accounting.shuffle; every accountant name gives the same epsilon). Its mechanism()
    is "shuffle", so that its state_dict is never loaded into a Poisson accountant, nor theirs
    into it. Not in the registry: PrivacyEngine(accountant=...) names a Poisson accountant."""

    MECHANISM = "shuffle"

    @classmethod
    def mechanism(cls) -> str:
        return cls.MECHANISM

    def get_epsilon(self, delta: float, **kwargs: Any) -> float:  # type: ignore[override]
        """Epsilon at `delta` (Opacus's accountant options, eps_error or alphas, do not apply)."""
        return super().get_epsilon(delta)


def opacus_accountant(accountant: Accountant) -> Accountant:
    """`accountant` with Opacus's interface: a core shuffle accountant (which make_private puts
    on the engine for shuffled batches) as `ShuffleAccountant` with its name and history, any
    other as is."""
    if isinstance(accountant, ShuffleAccountant) \
            or not isinstance(accountant, _shuffle.ShuffleAccountant):
        return accountant
    shaped = ShuffleAccountant(accountant.name)
    shaped.history = accountant.history
    return shaped


_ACCOUNTANTS: dict[str, type[Accountant]] = {
    "rdp": RDPAccountant, "prv": PRVAccountant, "gdp": GaussianAccountant}


def register_accountant(mechanism: str, accountant: type, force: bool = False) -> None:
    """Register an accountant class under `mechanism` (ValueError if taken, unless `force`)."""
    if mechanism in _ACCOUNTANTS and not force:
        raise ValueError(f"Accountant for mechanism {mechanism} is already registered")
    _ACCOUNTANTS[mechanism] = accountant


def create_accountant(mechanism: str) -> Accountant:
    """A new accountant for `mechanism` ("rdp" | "prv" | "gdp")."""
    if mechanism not in _ACCOUNTANTS:
        raise ValueError(f"Unexpected accountant type: {mechanism}")
    return _ACCOUNTANTS[mechanism]()


class IAccountant(_OpacusAccountant):
    """Opacus's accountant interface, for accountants written against it: subclasses implement
    step(noise_multiplier=, sample_rate=), get_epsilon(delta), __len__ and mechanism()."""

    name = "custom"

    def __init__(self) -> None:
        self._history: list = []

__all__ = ["IAccountant", "RDPAccountant", "PRVAccountant", "GaussianAccountant",
           "ShuffleAccountant", "create_accountant", "opacus_accountant", "register_accountant"]
from dptrain.opacus.accountants import registry  # noqa: E402  (Opacus exposes the submodule)
