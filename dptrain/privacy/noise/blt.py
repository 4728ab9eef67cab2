"""Buffered linear Toeplitz (BLT) noise (Dvijotham et al. 2024; McMahan et al. 2024).

C is lower-triangular Toeplitz with first column

    c_0 = 1,   c_k = sum_i omega_i theta_i^(k-1)   (k >= 1),

d buffer decays theta_i in (0, 1) and output scales omega_i > 0 with sum_i omega_i < 1, so that
c is positive and decreasing (the min-separation sensitivity formula's condition). As a series in
the delay z, C(z) = 1 + z sum_i omega_i / (1 - theta_i z) = P(z) / Q(z), a rational function of
degree d, so C^{-1} = Q / P is again BLT and both columns cost O(T d).

Noise: forward substitution with C through d running sums, one buffer per theta_i:

    y_t = Z_t - sum_i omega_i u_{i,t},    u_{i,t+1} = theta_i u_{i,t} + y_t   (u_{i,0} = 0),

since sum_{k>=1} c_k y_{t-k} = sum_i omega_i sum_{k>=1} theta_i^(k-1) y_{t-k}: d copies of the
trainable parameters, whatever the number of steps.

Parameters: `Blt.optimised(buffers, num_steps, min_sep, max_participations)` minimises
`toeplitz.loss` (the mean squared error of the running sum times the min-separation
sensitivity^2) by L-BFGS over unconstrained coordinates (theta = sigmoid(u), omega =
softmax-with-slack(v)), from three spreads of decays below 1 - 1/T (the best is kept). Each loss
evaluation is O(T d) (two rational filters).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter
from scipy.special import expit, logit
from torch import Tensor

from dptrain.checks import POSITIVE_INT
from dptrain.errors import ConfigError
from dptrain.privacy.noise import toeplitz
from dptrain.privacy.noise.base import NoiseGenerator, check_coefficients

_MAX_ITERATIONS = 1000
# Starting points: decays spread geometrically from 1 - 1/T down to 1 - top (L-BFGS from each).
_START_SPREADS = (0.5, 0.9, 0.99)


class BltGenerator(NoiseGenerator):
    """The recurrence of the module docstring; buffers: u_1, ..., u_d."""

    def __init__(self, buf_decay: tuple[float, ...], output_scale: tuple[float, ...]) -> None:
        super().__init__()
        self.buf_decay, self.output_scale = buf_decay, output_scale

    def _next(self, buffers: list[Tensor], draw: Tensor, step: int) -> Tensor:
        if step == 0:  # u_{i,0} = 0: nothing to subtract; the buffers start as y_0
            buffers[:] = [draw.clone() for _ in self.buf_decay]
            return draw
        for omega, buffer in zip(self.output_scale, buffers):
            draw.sub_(buffer, alpha=omega)
        for theta, buffer in zip(self.buf_decay, buffers):
            buffer.mul_(theta).add_(draw)
        return draw


def rational_form(buf_decay: np.ndarray, output_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q): polynomial coefficients in the delay z (ascending powers) with C(z) = P / Q:
    Q = prod_i (1 - theta_i z), P = Q + z sum_i omega_i prod_{j != i} (1 - theta_j z)."""
    q = np.array([1.0])
    for theta in buf_decay:
        q = np.convolve(q, [1.0, -theta])
    p = np.concatenate([q, [0.0]])
    for i, omega in enumerate(output_scale):
        others = np.array([1.0])
        for j, theta in enumerate(buf_decay):
            if j != i:
                others = np.convolve(others, [1.0, -theta])
        p[1:1 + others.size] += omega * others
    return p[:q.size], q


def blt_columns(buf_decay: np.ndarray, output_scale: np.ndarray,
                num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(c, r): the first columns of C and of C^{-1} (float64, shape (num_steps,)), O(T d)."""
    p, q = rational_form(buf_decay, output_scale)
    impulse = toeplitz.unit_impulse(num_steps)
    return lfilter(p, q, impulse), lfilter(q, p, impulse)


def _parameters(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(theta, omega) of the unconstrained point x = (u, v): theta = sigmoid(u) in (0, 1),
    omega = exp(v) / (1 + sum exp(v)) > 0 with sum(omega) < 1."""
    d = x.size // 2
    u, v = x[:d], x[d:]
    top = max(0.0, float(v.max()))
    weights = np.exp(v - top)
    return expit(u), weights / (np.exp(-top) + weights.sum())


def _coordinates(theta: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """The inverse of `_parameters`."""
    return np.concatenate([logit(theta), np.log(omega / (1.0 - omega.sum()))])


def blt_loss(buf_decay: np.ndarray, output_scale: np.ndarray, num_steps: int, *,
             min_sep: int = 1, max_participations: int | None = 1,
             momentum: float = 0.0) -> float:
    """`toeplitz.loss` of the BLT (inf when C^{-1} is unstable over the horizon)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an unstable C^{-1}: inf below
        c, r = blt_columns(buf_decay, output_scale, num_steps)
    if not np.all(np.isfinite(r)) or np.abs(r).max() > 1e6:
        return np.inf
    return toeplitz.loss(c, num_steps, momentum=momentum, min_sep=min_sep,
                         max_participations=max_participations, r=r)


def optimise_blt(buffers: int, num_steps: int, min_sep: int = 1,
                 max_participations: int | None = 1,
                 momentum: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(buf_decay, output_scale) of d = `buffers` buffers minimising `blt_loss`."""
    kwargs = {"min_sep": min_sep, "max_participations": max_participations,
              "momentum": momentum}
    starts = [_coordinates(1.0 - np.geomspace(1.0 / num_steps, top, buffers),
                           np.full(buffers, 0.5 / buffers)) for top in _START_SPREADS]
    scale = min(blt_loss(*_parameters(x), num_steps, **kwargs) for x in starts)

    def objective(x: np.ndarray) -> float:
        value = blt_loss(*_parameters(x), num_steps, **kwargs) / scale
        return value if np.isfinite(value) else 1e6

    results = [minimize(objective, x, method="L-BFGS-B",
                        options={"maxiter": _MAX_ITERATIONS, "ftol": 1e-13, "gtol": 1e-9})
               for x in starts]
    best = min(results, key=lambda result: result.fun).x
    theta, omega = _parameters(best)
    order = np.argsort(-theta)
    return theta[order], omega[order]


@dataclass(frozen=True)
class Blt:
    """BLT noise with `buf_decay` (theta_i in (0, 1)) and `output_scale` (omega_i > 0,
    sum < 1), one pair per buffer. Build it with `Blt.optimised(buffers, num_steps, ...)`."""

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    name = "blt"
    algorithm = "DP-MF (buffered linear Toeplitz)"
    noise_words = "correlated gaussian (BLT)"

    @staticmethod
    def preferred_groups(sample_rate: float, bands: int | None = None) -> int:
        """floor(1 / q) groups: each example about once per epoch, the min-separation schema
        its sensitivity is computed and its parameters optimised for."""
        return max(1, math.floor(1.0 / sample_rate + 1e-9))

    def __post_init__(self) -> None:
        theta = check_coefficients(self.buf_decay, "privacy.noise blt buf_decay",
                                   "one decay in (0, 1) per buffer")
        omega = check_coefficients(self.output_scale, "privacy.noise blt output_scale",
                                   "one positive scale per buffer")
        if len(theta) != len(omega):
            raise ConfigError(f"blt noise needs one output scale per buffer decay: got "
                              f"{len(theta)} decays and {len(omega)} scales.")
        if not all(0.0 < t < 1.0 for t in theta) or not all(w > 0 for w in omega) \
                or sum(omega) >= 1.0:
            raise ConfigError(f"blt noise parameters buf_decay={list(theta)}, output_scale="
                              f"{list(omega)} must have every decay in (0, 1) and positive scales "
                              "summing to less than 1 (a positive decreasing column, whose "
                              "sensitivity dptrain can bound).")
        object.__setattr__(self, "buf_decay", theta)
        object.__setattr__(self, "output_scale", omega)

    @classmethod
    def optimised(cls, buffers: int, num_steps: int, min_sep: int = 1,
                  max_participations: int | None = 1, momentum: float = 0.0) -> Blt:
        """The BLT with `buffers` buffers optimised for `num_steps` steps and an example that
        participates at most `max_participations` times, `min_sep` steps apart (`optimise_blt`);
        ConfigError naming privacy.noise_buffers when it is not an integer >= 1."""
        buffers = POSITIVE_INT.check(buffers, "privacy.noise_buffers")
        num_steps = POSITIVE_INT.check(num_steps, "the number of training steps")
        min_sep = POSITIVE_INT.check(min_sep, "min_sep")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum={momentum!r} must be in [0, 1) (the optimizer's).")
        theta, omega = optimise_blt(buffers, num_steps, min_sep, max_participations, momentum)
        return cls(tuple(theta), tuple(omega))

    @property
    def buffers(self) -> int:
        """d, the number of buffers (copies of the trainable parameters)."""
        return len(self.buf_decay)

    def toeplitz_column(self, num_steps: int) -> np.ndarray:
        """c_0 = 1, c_k = sum_i omega_i theta_i^(k-1) (float64, shape (num_steps,))."""
        return blt_columns(np.array(self.buf_decay), np.array(self.output_scale), num_steps)[0]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "buf_decay": list(self.buf_decay),
                "output_scale": list(self.output_scale)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Blt:
        return cls(tuple(data["buf_decay"]), tuple(data["output_scale"]))

    @property
    def extra_copies(self) -> int:
        return self.buffers

    def generator(self) -> BltGenerator:
        return BltGenerator(self.buf_decay, self.output_scale)
