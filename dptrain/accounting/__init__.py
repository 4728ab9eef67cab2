"""Privacy accountants (contract 2 of docs/architecture.md).

    acc = get_accountant("prv")            # "rdp" | "prv" | "gdp"
    acc.step(noise_multiplier=1.1, sample_rate=0.01, steps=1000)
    acc.get_epsilon(delta=1e-5)
"""

from dptrain.accounting.base import Accountant
from dptrain.accounting.calibration import get_noise_multiplier, steps_per_epoch
from dptrain.accounting.events import AccountingEvent, CorrelatedNoiseAccountant
from dptrain.accounting.history import History, merge_history
from dptrain.accounting.gdp import GaussianAccountant
from dptrain.accounting.matrix_factorization import Participation, sensitivity
from dptrain.accounting.prv import EpsilonBounds, PRVAccountant
from dptrain.accounting.rdp import DEFAULT_ORDERS, RDPAccountant
from dptrain.accounting.registry import ACCOUNTANTS, compute_epsilon, get_accountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "AccountingEvent",
    "CorrelatedNoiseAccountant",
    "DEFAULT_ORDERS",
    "EpsilonBounds",
    "GaussianAccountant",
    "History",
    "PRVAccountant",
    "Participation",
    "RDPAccountant",
    "compute_epsilon",
    "get_accountant",
    "get_noise_multiplier",
    "merge_history",
    "sensitivity",
    "steps_per_epoch",
]
