"""Accounting of random allocation ("balls in bins") with Gaussian noise: an upper bound.

**The scheme.** Each epoch has k = `steps_per_epoch` steps; every example goes into one of them,
chosen uniformly at random, independently of every other example and of earlier epochs (Chua et
al., AISTATS 2025; Feldman and Shenfeld 2025, "Privacy amplification by random allocation",
arXiv:2502.08202). Each step releases the sum of its examples' clipped gradients (norm <= C)
plus N(0, (sigma C)^2 I), divided by a *public* divisor (the expected batch size N / k, never
the realised one, which would leak the batch's size).

**Neighbouring relation: add/remove one example.** Because each example's step is drawn on its
own, adding an example draws one more step and leaves every other example where it was; the two
runs then differ only by that example's clipped gradient in one uniformly random step of each
epoch. In units of C, one epoch is the pair P = (1/k) sum_j N(e_j, sigma^2 I_k) ("with") and
Q = N(0, sigma^2 I_k) ("without") over the k steps' noise coordinates along the gradient.
Add/remove needs both orders: D(P||Q) ("remove") and D(Q||P) ("add"). The curves below are the
divergences of this pair; that the pair bounds the adaptive mechanism (DP-SGD picks each step's
gradients from earlier outputs) is Feldman-Shenfeld's reduction for random allocation, cited and
not re-proved here. The numbers for the pair are checked in
tests/accounting/test_random_allocation.py.

**Remove direction: exact Renyi divergence at integer orders** (Feldman-Shenfeld, Section 6).
With L = dP/dQ = (1/k) sum_j exp((x_j - 1/2) / sigma^2) and x_j iid N(0, sigma^2) under Q, the
multinomial expansion of E_Q[L^a] gives

    E_Q[L^a] = a! k^-a [z^a] f(z)^k,   f(z) = sum_{n >= 0} exp(n (n - 1) / (2 sigma^2)) z^n / n!,

and D_a(P||Q) = log E_Q[L^a] / (a - 1). We take f(z)^k by repeated squaring of polynomials
truncated at the largest order, in log space (every coefficient is positive, so no cancellation),
which gives every integer order up to it at once. k = 1 gives a / (2 sigma^2), the Gaussian.

**Add direction: the exact Renyi divergence, integrated numerically** at orders 2..128
(`_add_curve`): E_Q[L^-(a-1)] reduces to two nested one-dimensional integrals (the Laplace
transform of a lognormal, raised to the k-th power), summed by the trapezoid rule with an error
estimate added. It is the exact divergence up to that quadrature error (checked against
k-dimensional Gauss-Hermite quadrature at k = 2, 3, and below the closed-form AM-GM bound
1 / (2 sigma^2) + (a - 1) / (2 k sigma^2), which is proven but too loose over several epochs: it
adds 1 / (2 sigma^2) per epoch). Where that closed form (`add_epsilon_closed_form`, which also
bounds the loss itself by a shifted Gaussian's) is already below the remove direction's epsilon,
the quadrature is skipped and the result is proven end to end (the issue's scale point is such a
point); elsewhere, on every point we measured, the integrated add direction is still below the
remove direction's, so the figure is the remove direction's closed form (the `random-
allocation` package's RDP_DCO add-direction bound, by contrast, lies *below* this exact
divergence, e.g. 0.137 against 0.1437 at sigma 1, k = 10, order 2 (Monte Carlo: 0.1435 +- 0.0001),
so it is not used).

**Epochs compose in RDP**: E epochs add E times the per-epoch curve (adaptive composition of
Renyi DP). A started epoch is charged as a whole one: releasing only its first steps is a
post-processing of releasing all k. Each direction's composed curve is converted to (epsilon,
delta) with the tight conversion of `dptrain.accounting.rdp` and the larger epsilon is the
add/remove guarantee (a pair of datasets must satisfy it in both orders).

Everything is in nats; values are computed in float64 (no interval arithmetic, as the other
accountants). Per (sigma, k) the remove curve costs milliseconds and the add curve 0.1-8 s on one
core (cached). At sigma 1, delta 1e-4, 10 steps an epoch, 3 epochs: 3.276 (the package's
Feldman-Shenfeld analysis 3.276, its Dong-Chen-Ozgur RDP 3.80; Poisson at q = 0.1 by PLD 3.40).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
from scipy import special

from dptrain.accounting.base import Accountant
from dptrain.accounting.gdp import gdp_epsilon
from dptrain.accounting.history import History, steps_per_epoch as epoch_length
from dptrain.accounting.rdp import ADD, REMOVE, rdp_to_delta, rdp_to_epsilon
from dptrain.accounting.shuffle import epoch_sigmas
from dptrain.checks import check_delta, check_noise_multiplier, check_steps
from dptrain.errors import PrivacyError

MAX_ORDER = 512
DEFAULT_ORDERS: tuple[int, ...] = tuple(range(2, MAX_ORDER + 1))
ADD_MAX_ORDER = 128  # the add direction is integrated numerically at orders 2..128
ADD_ORDERS: tuple[int, ...] = tuple(range(2, ADD_MAX_ORDER + 1))
NEIGHBOURING = ("add/remove one example (every other example's step is drawn independently, "
                "so adding one moves no one else; sensitivity of a step's clipped sum C)")


def _log_poly_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Log-coefficients of the product of two polynomials given by log-coefficients [n + 1],
    truncated at degree n: c[m] = logsumexp_i (a[i] + b[m - i])."""
    n = a.size
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :] - i  # the index into b for output degree m = column
    terms = np.where(j >= 0, a[:, None] + b[np.clip(j, 0, None)], -np.inf)
    return special.logsumexp(terms, axis=0)


def _log_poly_pow(a: np.ndarray, power: int) -> np.ndarray:
    """Log-coefficients of a(z)^power truncated at a's degree, by repeated squaring."""
    result = np.full(a.size, -np.inf)
    result[0] = 0.0
    base = a
    while power:
        if power & 1:
            result = _log_poly_mul(result, base)
        power >>= 1
        if power:
            base = _log_poly_mul(base, base)
    return result


@lru_cache(maxsize=256)
def _remove_curve(sigma: float, k: int, max_order: int) -> np.ndarray:
    """D_a(P||Q) of one epoch for a = 0..max_order (entries 0 and 1 unused), shape [max_order + 1]."""
    n = np.arange(max_order + 1, dtype=np.float64)
    log_f = n * (n - 1) / (2 * sigma**2) - special.gammaln(n + 1)
    log_coef = _log_poly_pow(log_f, k)
    log_moment = special.gammaln(n + 1) - n * math.log(k) + log_coef  # log E_Q[L^a]
    out = np.zeros(max_order + 1)
    out[2:] = np.maximum(log_moment[2:], 0.0) / (n[2:] - 1)
    out.setflags(write=False)
    return out


def _orders(orders: Sequence[int]) -> np.ndarray:
    out = np.asarray(orders)
    if out.size == 0 or not np.all(out == np.round(out)) or out.min() < 2:
        raise PrivacyError(f"orders={orders!r} is invalid: random allocation is accounted at "
                           "integer RDP orders >= 2 (the exact expansion needs integers).")
    return out.astype(np.int64)


def _check(sigma: float, steps_per_epoch: int, epochs: int) -> tuple[float, int, int]:
    s = check_noise_multiplier(sigma, "sigma")
    k = check_steps(steps_per_epoch, "steps_per_epoch")
    if k < 1:
        raise PrivacyError(f"steps_per_epoch={steps_per_epoch!r} must be >= 1: the number of "
                           "steps (batches) each epoch's examples are allocated to.")
    return s, k, check_steps(epochs, "epochs")


def rdp_remove(sigma: float, steps_per_epoch: int, epochs: int = 1,
               orders: Sequence[int] = DEFAULT_ORDERS) -> np.ndarray:
    """Renyi divergence D_a(with || without) of `epochs` epochs, shape [len(orders)], nats:
    exact per epoch (see the module docstring), times the number of epochs."""
    s, k, e = _check(sigma, steps_per_epoch, epochs)
    a = _orders(orders)
    if s == 0.0:
        return np.full(a.size, math.inf if e else 0.0)
    return e * _remove_curve(s, k, int(a.max()))[a]


def _log_laplace_lognormal(u: np.ndarray, sigma: float, h_w: float, w_max: float) -> np.ndarray:
    """log E[exp(-e^u Y)] [len(u)] for Y = e^W, W ~ N(0, 1 / sigma^2): trapezoid rule in w on
    [-w_max, 12 / sigma + 5] (the integrand is negligible outside), in log space."""
    tau = 1 / sigma
    w = np.arange(-w_max, 12 * tau + 5, h_w)
    log_n = -w**2 / (2 * tau**2) - math.log(tau * math.sqrt(2 * math.pi)) + math.log(h_w)
    out = np.empty(u.size)
    chunk = max(1, (1 << 23) // w.size)  # keeps the [chunk, len(w)] matrix near 64 MiB
    for s in range(0, u.size, chunk):
        out[s:s + chunk] = special.logsumexp(log_n[None, :] - np.exp(u[s:s + chunk, None] + w[None, :]),
                                             axis=1)
    return np.minimum(out, 0.0)


def _add_curve_at(sigma: float, k: int, betas: np.ndarray, step: float) -> np.ndarray:
    """D_{b+1}(Q||P) of one epoch for b in betas [B], by quadrature with grid steps scaled by
    `step` (see `_add_curve`)."""
    width = 1 / (sigma * math.sqrt(k) + math.sqrt(k) + 1)  # the integrand's narrowest peak in u
    h_u = 0.25 * width * step
    u_lo = -math.log(k) - 1 / (2 * sigma**2) - 40
    u_hi = betas.max() / (k * sigma**2) + 12 * width * math.sqrt(betas.max()) + 10
    u = np.arange(u_lo, u_hi + h_u, h_u)
    log_phi = _log_laplace_lognormal(u, sigma, min(1 / sigma, 1.0) / 10 * step, u_hi + 12 / sigma + 10)
    b = betas.astype(np.float64)
    integral = special.logsumexp(b[:, None] * u[None, :] + k * log_phi[None, :], axis=1) + math.log(h_u)
    integral = np.logaddexp(integral, b * u_lo - np.log(b))  # u < u_lo, where phi <= 1
    log_moment = b * math.log(k) - special.gammaln(b) + integral + b / (2 * sigma**2)
    return log_moment / b


@lru_cache(maxsize=256)
def _add_curve(sigma: float, k: int) -> np.ndarray:
    """D_a(Q||P) of one epoch for a = 0..ADD_MAX_ORDER (entries 0 and 1 unused).

    With beta = a - 1 and Ybar = (1/k) sum_j e^{x_j / sigma^2}, L = e^{-1/(2 sigma^2)} Ybar and
    E_Q[L^-beta] = e^{beta / (2 sigma^2)} E[Ybar^-beta], where, from
    y^-beta = (1 / Gamma(beta)) int_0^inf t^(beta-1) e^{-t y} dt and t = k e^u,
    E[Ybar^-beta] = (k^beta / Gamma(beta)) int e^{beta u} phi(e^u)^k du, phi the Laplace
    transform of one lognormal Y. Both integrals are smooth and decay fast (trapezoid rule, whose
    error falls exponentially with the step); the part u < u_lo is bounded with phi <= 1. The
    error is estimated by doubling both steps and the difference is added (an estimate, as the
    PRV accountant's FFT round-off). k = 1 gives a / (2 sigma^2) (the Gaussian) to 1e-12.
    """
    # The integrand peaks near u = beta / (k sigma^2): orders whose peak lies beyond u = 200 (small
    # sigma, where the best order is small anyway) are left at +inf, a valid if useless value.
    top = int(min(ADD_MAX_ORDER - 1, max(1, math.floor(200 * k * sigma**2))))
    betas = np.arange(1, top + 1)
    fine = _add_curve_at(sigma, k, betas, 1.0)
    coarse = _add_curve_at(sigma, k, betas, 2.0)
    out = np.full(ADD_MAX_ORDER + 1, math.inf)
    out[:2] = 0.0
    out[2:top + 2] = np.maximum(fine + np.abs(fine - coarse) + 1e-12, 0.0)
    out.setflags(write=False)
    return out


def rdp_add(sigma: float, steps_per_epoch: int, epochs: int = 1,
            orders: Sequence[int] = ADD_ORDERS) -> np.ndarray:
    """Renyi divergence D_a(without || with) of `epochs` epochs, shape [len(orders)], nats, at
    orders 2..ADD_MAX_ORDER: the exact divergence of one epoch integrated numerically (see
    `_add_curve`; k = 1: the Gaussian's a / (2 sigma^2) in closed form), times the epochs."""
    s, k, e = _check(sigma, steps_per_epoch, epochs)
    a = _orders(orders)
    if a.max() > ADD_MAX_ORDER:
        raise PrivacyError(f"orders={orders!r} is invalid: the add direction is computed at "
                           f"integer orders 2..{ADD_MAX_ORDER}.")
    if s == 0.0:
        return np.full(a.size, math.inf if e else 0.0)
    if k == 1:
        return e * a / (2 * s**2)
    return e * _add_curve(s, k)[a]


def rdp(sigma: float, steps_per_epoch: int, epochs: int = 1,
        orders: Sequence[int] = ADD_ORDERS) -> np.ndarray:
    """RDP curve of the run under add/remove (both orders of the pair), shape [len(orders)],
    nats: the larger of `rdp_remove` and `rdp_add` at each order (2..ADD_MAX_ORDER). Composes
    with other RDP curves by addition; `epsilon` converts each direction on its own, which is
    never larger."""
    return np.maximum(rdp_remove(sigma, steps_per_epoch, epochs, orders),
                      rdp_add(sigma, steps_per_epoch, epochs, orders))


def add_epsilon_closed_form(sigma: float, steps_per_epoch: int, epochs: int, delta: float) -> float:
    """A proven upper bound (nats) on the add direction's epsilon at `delta`, in closed form.

    By the AM-GM inequality the add direction's privacy loss of one epoch is at most
    1 / (2 sigma^2) - (sum_j x_j) / (k sigma^2) at every output (x in units of C). Summed over
    E epochs, sum_j x_j ~ N(0, E k sigma^2) under "without", so the loss is at most a
    Gaussian pair's loss with mu = sqrt(E / k) / sigma, shifted by E (1 - 1/k) / (2 sigma^2), and
    epsilon_add <= gdp_epsilon(mu, delta) + E (1 - 1/k) / (2 sigma^2) (the hockey-stick
    divergence grows with the loss). The same inequality in RDP, E (1 / (2 sigma^2) +
    (a - 1) / (2 k sigma^2)), is also converted; the smaller epsilon is returned.
    """
    s, k, e = _check(sigma, steps_per_epoch, epochs)
    d = check_delta(delta)
    if s == 0.0:
        return math.inf if e else 0.0
    shift = e * (1 - 1 / k) / (2 * s**2)
    shifted_gaussian = gdp_epsilon(math.sqrt(e / k) / s, d) + shift
    a = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
    am_gm = rdp_to_epsilon(e * (1 / (2 * s**2) + (a - 1) / (2 * k * s**2)), DEFAULT_ORDERS, d)[0]
    return min(shifted_gaussian, am_gm)


def epsilon_by_direction(sigma: float, steps_per_epoch: int, epochs: int,
                         delta: float) -> tuple[float, float]:
    """(remove, add) epsilons (nats) at `delta` of the composed run.

    remove: from the exact remove-direction RDP curve (orders 2..MAX_ORDER, tight conversion).
    add: `add_epsilon_closed_form` (proven) when it is already no larger than remove, so the
    result needs no quadrature; otherwise the smaller of it and the epsilon of the integrated
    add-direction curve (orders 2..ADD_MAX_ORDER; exact up to the estimated quadrature error).
    """
    d = check_delta(delta)
    remove = rdp_to_epsilon(rdp_remove(sigma, steps_per_epoch, epochs), DEFAULT_ORDERS, d)[0]
    add = add_epsilon_closed_form(sigma, steps_per_epoch, epochs, d)
    if add > remove:
        add = min(add, rdp_to_epsilon(rdp_add(sigma, steps_per_epoch, epochs), ADD_ORDERS, d)[0])
    return remove, add


def epsilon(sigma: float, steps_per_epoch: int, epochs: int, delta: float) -> float:
    """Epsilon (nats) at `delta` of `epochs` epochs of random allocation into `steps_per_epoch`
    steps with noise multiplier `sigma`, under add/remove: the larger of the two directions'
    epsilons (`epsilon_by_direction`). 0 for zero epochs; inf for sigma = 0."""
    if check_steps(epochs, "epochs") == 0:
        return 0.0  # nothing released (the RDP conversion of a zero curve is not exactly 0)
    return max(epsilon_by_direction(sigma, steps_per_epoch, epochs, delta))


# -- a run's history: epochs of k = ceil(1 / q) steps ---------------------------------------------
def _epochs(history: History) -> tuple[int, list[float]]:
    """(k, the smallest sigma of each started epoch): an epoch is k = steps_per_epoch(q)
    consecutive steps counted from the first (one q for the whole run: PrivacyError otherwise);
    a started epoch is charged as a whole one (its first steps are a post-processing of all k)."""
    sigmas = epoch_sigmas(history)
    return epoch_length(history[0][1]), sigmas


def _composed_curve(k: int, sigmas: list[float]) -> np.ndarray:
    """RDP curve [len(ADD_ORDERS)] of epochs of the given sigmas composed: per epoch the larger
    of the two directions at each order (`rdp`), added (adaptive composition of Renyi DP)."""
    return sum((rdp(s, k, 1) for s in sigmas), np.zeros(len(ADD_ORDERS)))


#: each direction's curve of one run and the integer orders it is computed at
DIRECTION_CURVES = {REMOVE: rdp_remove, ADD: rdp_add}
DIRECTION_ORDERS = {REMOVE: DEFAULT_ORDERS, ADD: ADD_ORDERS}


def history_rdp(history: History, orders: Sequence[int], direction: str) -> np.ndarray:
    """RDP curve [len(orders)] (nats) of a run's (sigma, q, steps) history in one `direction` of
    the add/remove pair (rdp.REMOVE: D(with || without), orders 2..MAX_ORDER; rdp.ADD:
    D(without || with), orders 2..ADD_MAX_ORDER: DIRECTION_ORDERS): each epoch's curve
    (`rdp_remove` / `rdp_add`) at its smallest sigma, added. Another run's curve of the same
    direction adds to it (adaptive composition of Renyi DP): how a sweep composes its jobs."""
    if not history:
        return np.zeros(len(orders))
    k, sigmas = _epochs(history)
    curve = DIRECTION_CURVES[direction]
    return sum((curve(s, k, sigmas.count(s), orders) for s in sorted(set(sigmas))),
               np.zeros(len(orders)))


def history_epsilon(history: History, delta: float) -> float:
    """Epsilon (nats) at `delta` of a run's (sigma, q, steps) history under random allocation:
    `epsilon` of its epochs when every epoch has one sigma, else the composed RDP curves of the
    epochs (each at its smallest sigma) converted at delta."""
    k, sigmas = _epochs(history)
    if len(set(sigmas)) == 1:
        return epsilon(sigmas[0], k, len(sigmas), delta)
    return rdp_to_epsilon(_composed_curve(k, sigmas), ADD_ORDERS, check_delta(delta))[0]


class RandomAllocationAccountant(Accountant):
    """The accountant of balls-in-bins batches (random allocation, add/remove): `history_epsilon`.

    It carries the name of the accountant the run configured (`name`), so that the ledger's
    claims and recomputations under that name agree; every name gives the same epsilon (the
    random-allocation analysis above, never a Poisson one).
    """

    approximate = False
    guarantee = "upper bound (random allocation, add/remove adjacency)"
    sampling = "balls_in_bins"

    def __init__(self, name: str = "prv") -> None:
        super().__init__()
        self.name = name

    def _epsilon(self, runs: History, delta: float) -> float:
        return history_epsilon(runs, delta)

    def _delta(self, runs: History, epsilon_: float) -> float:
        k, sigmas = _epochs(runs)
        return rdp_to_delta(_composed_curve(k, sigmas), ADD_ORDERS, epsilon_)[0]
