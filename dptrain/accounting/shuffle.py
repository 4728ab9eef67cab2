"""Accounting for shuffled batches, without amplification by subsampling.

With `sampling=shuffle` each epoch is a fresh random permutation of the N examples cut into
fixed-size batches of B = q N, so every example is in exactly one batch of each epoch (the last
epoch's may be partial). No amplification is claimed: the accounting below holds even if the
permutation were public.

Neighbouring relation: **substitution** (replace-one): two datasets of the same size N differing
in one example. The batches' positions are then the same for both, and the one changed example
is in exactly one batch per epoch; the clipped sum of that batch moves by at most 2 C (both
contributions have norm <= C), every other step is unchanged. Conditioned on the permutation, an
epoch is one Gaussian mechanism of sensitivity 2 C and noise std sigma C, i.e. mu_e-GDP with
mu_e = 2 / sigma (the smallest sigma of the epoch's steps when sigma varies), and epochs compose
exactly as Gaussians: mu = sqrt(sum_e mu_e^2) = 2 sqrt(E) / sigma for E epochs of a constant
sigma. (Add/remove adjacency does not fit fixed-size batches: removing an example shifts every
later batch.) Epsilon is read off mu-GDP at delta exactly (`gdp_epsilon`; Dong, Roth, Su 2019),
the same closed form as `dp_accounting`'s PLD of the composed GaussianDpEvent. It does not depend
on the accountant chosen: every accountant returns it. Under substitution an epsilon is roughly
twice the add/remove epsilon of the same mechanism; Poisson runs are accounted under add/remove.
"""

from __future__ import annotations

import math

from dptrain.accounting.base import Accountant
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.history import History, steps_per_epoch
from dptrain.errors import PrivacyError

# The L2 sensitivity of one batch's clipped sum under substitution, in units of C.
SENSITIVITY = 2.0
NEIGHBOURING = "substitution (replace one example; sensitivity of the clipped sum 2 C)"


def epoch_sigmas(history: History) -> list[float]:
    """The smallest sigma of each (started) epoch of a shuffled history, in order.

    An epoch is `steps_per_epoch(q)` consecutive steps; every run must have the same q (a
    shuffled run has a fixed batch size). A partial last epoch is charged as a whole one.
    """
    rates = {q for _, q, _ in history}
    if len(rates) > 1:
        raise PrivacyError(f"a shuffled history has a fixed sample rate, got {sorted(rates)}: "
                           "shuffled batches cannot follow a sample-rate schedule.")
    sigmas: list[float] = []
    position = 0
    length = steps_per_epoch(next(iter(rates))) if rates else 1
    for sigma, _, steps in history:
        for _ in range(int(steps)):
            if position % length == 0:
                sigmas.append(sigma)
            else:
                sigmas[-1] = min(sigmas[-1], sigma)
            position += 1
    return sigmas


def shuffle_mu(history: History) -> float:
    """mu of the composed per-epoch Gaussian mechanisms: sqrt(sum_e (2 / sigma_e)^2)."""
    sigmas = epoch_sigmas(history)
    if any(s == 0.0 for s in sigmas):
        return math.inf
    return math.sqrt(sum((SENSITIVITY / s) ** 2 for s in sigmas))


def shuffle_epsilon(history: History, delta: float) -> float:
    """Epsilon at `delta` of a shuffled history (substitution adjacency, no amplification)."""
    return gdp_epsilon(shuffle_mu(history), delta)


def check_epochs_aligned(steps_charged: int, position: int, pass_length: int, loader: str) -> None:
    """PrivacyError unless an accountant holding `steps_charged` steps starts its epochs where a
    shuffled loader (`loader`, in words), `position` batches into a pass of `pass_length`
    batches, starts its passes. Otherwise a pass would begin inside an epoch already charged, and
    an example could be in two batches of that epoch, charged as one: the one rule every
    shuffled selection (sampling shuffle and given_shuffle) checks when a loader and a history
    meet (make_private, loading a saved state)."""
    if (steps_charged - position) % pass_length == 0:
        return
    raise PrivacyError(
        f"the accountant holds {steps_charged} steps, but the data loader charged as a shuffle "
        f"({loader}) is {position} batches into a pass of {pass_length}: its next pass would "
        "begin inside an epoch already charged, where an example could be in two batches "
        "charged as one. Save checkpoints at the end of a pass (a multiple of "
        f"{pass_length} steps) and load them before iterating the loader (with sampling="
        "'shuffle' and reproducible randomness, PrivacyEngine.load_state_dict also restores "
        "a shuffle saved mid-pass), or make a fresh PrivacyEngine private for a new run.")


class ShuffleAccountant(Accountant):
    """The accountant of a shuffled run: the exact composed-Gaussian epsilon above.

    It carries the name of the accountant the run configured (`name`), so that the ledger's
    claims and recomputations under that name agree; every name gives the same epsilon.
    """

    approximate = False
    guarantee = "exact (composed Gaussian mechanisms, substitution adjacency)"
    sampling = "shuffle"

    def __init__(self, name: str = "prv") -> None:
        super().__init__()
        self.name = name

    def _epsilon(self, runs: History, delta: float) -> float:
        return shuffle_epsilon(runs, delta)

    def _delta(self, runs: History, epsilon: float) -> float:
        return gdp_delta(shuffle_mu(runs), epsilon)


__all__ = ["NEIGHBOURING", "SENSITIVITY", "ShuffleAccountant", "check_epochs_aligned",
           "epoch_sigmas", "shuffle_epsilon", "shuffle_mu"]
