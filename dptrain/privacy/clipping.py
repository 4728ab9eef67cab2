"""Per-sample clipping strategies: flat, per-layer and adaptive (Andrew et al. 2021).

A clipper turns the per-sample gradients of one physical chunk into per-parameter clipped sums,
using only the clipping interface of contract 1 (`squared_norms()` and `weighted_sum()`), so the
hooks module (GradSampleModule) and the ghost module (GhostClippingModule) are interchangeable sources.

For a chunk of B samples with per-sample gradients g_b (over all parameters p):

* flat: factor_b = min(1, C / (||g_b|| + eps)), the same for every parameter, so each sample's
  clipped contribution has total L2 norm <= C; sensitivity C.
* per-layer: factor_{b,k} = min(1, C_k / (||g_{b,k}|| + eps)) per parameter k; sensitivity
  sqrt(sum_k C_k^2). By default C_k = C / sqrt(K) for K parameters, so the sensitivity is C.
* adaptive: flat clipping whose C follows a target quantile of the per-sample norms, estimated
  privately; see `AdaptiveClipper`.

Non-finite examples (`finite_samples`, applied by `Clipper.clip` for every mode): a sample whose
squared norm is not finite for some parameter (a NaN or inf feature, an overflow in its forward or
backward) is excluded: its norm counts as +inf in every parameter, its factor is exactly 0, and
the source drops its values from the sums (a zero weight is a strong zero, see
`PerSampleSource.weighted_sum`: 0 * NaN would be NaN); adaptive clipping's count leaves it out
(u = 0, within the |u| <= 1/2 of its sensitivity). The released step is then the one the batch
without it gives (same noise): it does not reveal that the example was sampled. How many were
excluded is a statistic of the training data, for the private metrics only
(`Clipper.pop_excluded`).

Precision: norms, clip factors and clipped sums are formed in float32 for 16-bit (bf16, fp16)
parameters, in the parameters' dtype otherwise (`norm_dtype`). In 16 bits each rounding is up to
2^-8 (bf16) or 2^-11 (fp16) of the value, so a 16-bit norm, factor or sum lifts one sample's
contribution above C (by up to 0.5% in bf16); in float32 the few roundings left are covered by the
SAFETY_ULPS margin. Only the final noisy gradient is cast to the parameters' dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dptrain.checks import check_max_grad_norm
from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.ghost_math import norm_dtype

#: Clip factors use the bound C * (1 - SAFETY_ULPS * eps(dtype)), so that the clipped norm stays
#: <= C despite the few roundings after the squared norms are known (casts, sqrt, division,
#: reweighting; a relative bias of ~1e-15 in float64, ~1e-6 in float32). A zero norm gives
#: C / 0 = inf, clamped to a factor of 1 (its gradient is zero anyway): no epsilon is added to
#: norms, so clipping is exact up to that margin. The margin does not cover cancellation: a source
#: whose norms are computed along another route than its sums (ghost mode) must return squared
#: norms that are never below the true ones (see dptrain.grad_sample.ghost_math).
SAFETY_ULPS = 8


class PerSampleSource(Protocol):
    """The clipping interface of contract 1 (GradSampleModule, GhostClippingModule).

    `squared_norms` returns {p: Tensor[B]} and `weighted_sum` {p: Tensor[*p.shape]}, both in
    `norm_dtype(p)` (float32 for 16-bit parameters) or wider; its weights are float32/64.
    """

    def per_sample_batch_size(self) -> int: ...

    def squared_norms(self) -> dict[nn.Parameter, Tensor]: ...

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """sum_b weights[p][b] * g_b(p); a sample with a zero weight contributes nothing, its
        values (NaN or inf included) never reach the sum
        (`dptrain.grad_sample.ghost_math.dropped_samples`)."""

    def clear_per_sample(self) -> None: ...

    def check_complete(self) -> None: ...


#: fn(std) -> one scalar Gaussian draw N(0, std^2) from the optimizer's noise source.
ScalarNoise = Callable[[float], float]


def squared_totals(squared: dict[nn.Parameter, Tensor]) -> Tensor:
    """Per-sample squared L2 norm over all parameters, sum_p squared[p]: Tensor[B] float64.

    Accumulated in float64: a float32 sum of K terms could round down by up to ~K ulps (more than
    the clipping margin), and no float32 sum of them can overflow there.
    """
    return torch.stack([t.double() for t in squared.values()]).sum(dim=0)


def total_norms(squared: dict[nn.Parameter, Tensor], totals: Tensor | None = None) -> Tensor:
    """Per-sample L2 norm over all parameters: sqrt(sum_p squared[p]); Tensor[B], float32/64.

    Float64 if any input is, else float32, from the float64 `squared_totals` (`totals`: those
    of `squared`, when the caller already has them).
    """
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in squared.values()) else torch.float32
    return (squared_totals(squared) if totals is None else totals).sqrt().to(dtype)


def layer_norms(squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    """Per-sample L2 norm of each parameter's gradient: {p: Tensor[B]}, float32/64."""
    return {p: sq.to(norm_dtype(sq)).sqrt() for p, sq in squared.items()}


def check_width(source: PerSampleSource, method: str, values: dict[nn.Parameter, Tensor]) -> None:
    """PrivacyError unless every `values[p]` (a source's norms or sums) is in `norm_dtype(p)` or
    wider: a norm rounded down, or a sum rounded, to 16 bits lifts a sample above the bound."""
    for p, value in values.items():
        if torch.finfo(value.dtype).eps > torch.finfo(norm_dtype(p)).eps:
            raise PrivacyError(
                f"{type(source).__name__}.{method} returned {value.dtype} values for a {p.dtype} "
                f"parameter of shape {tuple(p.shape)}: rounded to {value.dtype}, a sample's clipped "
                f"contribution can exceed max_grad_norm. A per-sample source must form norms and "
                f"clipped sums in {norm_dtype(p)} or wider "
                f"(dptrain.grad_sample.ghost_math.norm_dtype).")


def finite_samples(squared: dict[nn.Parameter, Tensor]) -> Tensor:
    """Tensor[B] bool: the samples whose squared norms are finite for every parameter.

    THE rule of non-finite examples (see the module docstring): the others are excluded from the
    clipped sum. The squared norms are added in float64 (no float32 sum can overflow there), so a
    sample is kept exactly when its squared total norm is finite.
    """
    return finite_totals(squared_totals(squared))


def finite_totals(totals: Tensor) -> Tensor:
    """Tensor[B] bool: which float64 `squared_totals` are finite. `|x| < inf` is
    `torch.isfinite(x)` (False for NaN and +-inf, True otherwise) in two kernels instead of
    four: part of the fixed cost of a step."""
    return totals.abs() < math.inf


def excluded_as_infinite(squared: dict[nn.Parameter, Tensor], kept: Tensor) -> dict[nn.Parameter, Tensor]:
    """`squared` ({p: Tensor[B]}) with +inf for every parameter of the samples not `kept`: each
    clipping mode then gives them a factor of 0 (and adaptive clipping leaves them out of its
    count)."""
    return {p: sq.masked_fill(~kept.to(sq.device), math.inf) for p, sq in squared.items()}


def clip_factors(norms: Tensor, bound: float) -> Tensor:
    """min(1, bound' / norm) for each sample, bound' = bound minus a few ulps; Tensor[B] like
    `norms` (see SAFETY_ULPS)."""
    safe_bound = bound * (1.0 - SAFETY_ULPS * torch.finfo(norms.dtype).eps)
    return (safe_bound / norms).clamp(max=1.0)


class Clipper(ABC):
    """A per-sample clipping strategy; `sensitivity` bounds one sample's clipped contribution."""

    name: str = "clipper"

    @property
    @abstractmethod
    def max_grad_norm(self) -> float:
        """The L2 sensitivity of one sample's clipped contribution over all parameters."""

    @abstractmethod
    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """Clip factors per parameter, Tensor[B] each, from per-sample squared norms."""

    def clip(self, source: PerSampleSource) -> dict[nn.Parameter, Tensor]:
        """Clipped per-parameter sums of the source's current chunk: {p: Tensor[*p.shape]} in
        `norm_dtype(p)` or wider (float32 for 16-bit parameters).

        A sample with a non-finite norm gets a factor of exactly 0 and no place in the sums
        (`finite_samples`; counted for `pop_excluded`). The factors go to the source as they are
        (float32/64): rounded to a 16-bit parameter's dtype they could round up. Raises
        PrivacyError when the source returns norms or sums narrower than `norm_dtype(p)` (see
        `check_width`).
        """
        squared = source.squared_norms()
        check_width(source, "squared_norms", squared)
        totals = squared_totals(squared)
        kept = finite_totals(totals)  # = finite_samples(squared), the sum formed once
        excluded = (~kept).sum()
        self.excluded = self.excluded + excluded  # a tensor: no wait for the accelerator
        if not bool(excluded):
            # The usual case, and the same values as below: with every sample kept both masks
            # are all False. Skipping them saves 2 K + 2 small ops a step (K parameters), a
            # fixed cost that dominates small models; the one wait for the accelerator here
            # comes just before the source's own (dropped_samples). The factors may reuse the
            # float64 totals of these very norms (`_total_norms`).
            self._known_totals = (squared, totals)
            try:
                sums = source.weighted_sum(self.factors(squared))
            finally:
                self._known_totals = None
        else:
            factors = self.factors(excluded_as_infinite(squared, kept))
            # 0, not whatever a factors() override makes of an infinite norm
            sums = source.weighted_sum({p: f.masked_fill(~kept.to(f.device), 0.0)
                                        for p, f in factors.items()})
        check_width(source, "weighted_sum", sums)
        return sums

    #: Samples of the logical batch being clipped that were excluded for a non-finite norm
    #: (an int or a 0-dim tensor): private, like every statistic of the training data.
    excluded: Tensor | int = 0

    #: (squared, squared_totals(squared)) while `clip` asks for the factors of `squared`
    _known_totals: tuple[dict[nn.Parameter, Tensor], Tensor] | None = None

    def _total_norms(self, squared: dict[nn.Parameter, Tensor]) -> Tensor:
        """`total_norms(squared)`, from the float64 totals `clip` formed for these very norms
        when it has them (the same values: one stack and sum less a step)."""
        known = self._known_totals
        return total_norms(squared, known[1] if known is not None and known[0] is squared else None)

    def pop_excluded(self) -> Tensor | int:
        """The samples excluded since the last call (`excluded`: a 0-dim tensor, or 0), which is
        reset to 0; taken once per step by the optimizer (for the private metrics only)."""
        count, self.excluded = self.excluded, 0
        return count

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """The sigma applied to the gradient sum, given the accounted sigma (equal by default)."""
        return noise_multiplier

    def end_step(self, scalar_noise: ScalarNoise, expected_batch_size: float) -> None:
        """Called once after each logical step (adaptive clipping updates its bound here)."""

    def reset_accumulation(self) -> None:
        """Forget statistics gathered from an abandoned logical batch (adaptive: the count)."""
        self.excluded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name", self.name) != self.name:
            raise ConfigError(f"Cannot load {state.get('name')!r} clipping state into "
                              f"clipping={self.name!r}: use the saved run's clipping.")


class FlatClipper(Clipper):
    """Clip each sample's gradient to total L2 norm <= C over all parameters."""

    name = "flat"

    def __init__(self, max_grad_norm: float) -> None:
        self._bound = check_max_grad_norm(max_grad_norm)

    @property
    def max_grad_norm(self) -> float:
        return self._bound

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        factor = clip_factors(self._total_norms(squared), self._bound)
        return {p: factor for p in squared}


class PerLayerClipper(Clipper):
    """Clip each parameter's per-sample gradient to its own bound C_k.

    Args:
        max_grad_norm: a total C split equally as C_k = C / sqrt(K), or a list of K bounds in the
            order of `params`.
        params: the trainable parameters, in model order (K of them).
    """

    name = "per_layer"

    def __init__(self, max_grad_norm: float | Sequence[float], params: Sequence[nn.Parameter]) -> None:
        params = list(params)
        if not params:
            raise ConfigError("clipping='per_layer' needs at least one trainable parameter.")
        if isinstance(max_grad_norm, (int, float)):
            total = check_max_grad_norm(max_grad_norm)
            bounds = [total / math.sqrt(len(params))] * len(params)
        else:
            bounds = [check_max_grad_norm(b, f"max_grad_norm[{i}]") for i, b in enumerate(max_grad_norm)]
            if len(bounds) != len(params):
                raise ConfigError(f"max_grad_norm has {len(bounds)} per-layer bounds but the model has "
                                  f"{len(params)} trainable parameters: give one bound per parameter "
                                  "(in model order) or a single float to split equally.")
        self.bounds: dict[nn.Parameter, float] = dict(zip(params, bounds))

    @property
    def max_grad_norm(self) -> float:
        return math.sqrt(sum(b * b for b in self.bounds.values()))

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return {p: clip_factors(norm, self.bounds[p]) for p, norm in layer_norms(squared).items()}


class AdaptiveClipper(FlatClipper):
    """Flat clipping whose bound tracks a quantile of per-sample norms (Andrew et al. 2021).

    Each sample contributes the centred indicator u_i = 1[||g_i|| <= C] - 1/2 (in {-1/2, +1/2}).
    After each logical step the released count is  sum_i u_i + N(0, sigma_b^2)  (summed over the
    logical batch), and the privately estimated unclipped fraction is
    b = clamp(released / expected_batch_size + 1/2, 0, 1); the bound then moves geometrically
    towards the target quantile gamma:  C <- C * exp(-eta * (b - gamma)).

    Privacy (Andrew et al. 2021, Theorem 1): adding or removing one example changes sum_i u_i by
    at most 1/2 (this is why the indicator is centred: the raw count sum_i 1[...] would have
    sensitivity 1, and the 1/2 added back is public because it uses the expected, not the actual,
    batch size). The count is thus a Gaussian mechanism with multiplier 2 sigma_b, and released
    together with the gradient sum noised with multiplier z_grad it costs exactly as much as one
    Gaussian mechanism with multiplier z, where z^-2 = z_grad^-2 + (2 sigma_b)^-2. So the gradient
    gets z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2) > z, and the accountant is stepped with the
    configured z. This needs sigma_b > z / 2.

    Args:
        max_grad_norm: the initial bound C_0.
        target_unclipped_quantile: gamma in [0, 1], the fraction of samples to leave unclipped.
        clipbound_learning_rate: eta > 0.
        count_noise_std: sigma_b, std of the noise on the centred unclipped count (in samples);
            Andrew et al. suggest expected_batch_size / 20.
    """

    name = "adaptive"

    def __init__(self, max_grad_norm: float, target_unclipped_quantile: float,
                 clipbound_learning_rate: float, count_noise_std: float) -> None:
        super().__init__(max_grad_norm)
        if not 0.0 <= target_unclipped_quantile <= 1.0:
            raise ConfigError(f"target_unclipped_quantile={target_unclipped_quantile!r} must be in "
                              "[0, 1] (the fraction of samples left unclipped, e.g. 0.5).")
        if not clipbound_learning_rate > 0:
            raise ConfigError(f"clipbound_learning_rate={clipbound_learning_rate!r} must be > 0 "
                              "(e.g. 0.2).")
        if not (math.isfinite(count_noise_std) and count_noise_std >= 0):
            raise PrivacyError(f"count_noise_std={count_noise_std!r} must be a finite std >= 0 "
                               "(in samples; e.g. expected_batch_size / 20).")
        self.target_unclipped_quantile = float(target_unclipped_quantile)
        self.clipbound_learning_rate = float(clipbound_learning_rate)
        self.count_noise_std = float(count_noise_std)
        self.centred_count = 0.0

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        norms = self._total_norms(squared)
        unclipped = float((norms <= self._bound).sum())
        # sum of 1[norm <= C] - 1/2 over the samples present: an excluded one (+inf, see
        # Clipper.clip) adds 0, as if it had not been sampled (|u| <= 1/2 still)
        self.centred_count += unclipped - 0.5 * float(torch.isfinite(norms).sum())
        factor = clip_factors(norms, self._bound)
        return {p: factor for p in squared}

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        if noise_multiplier == 0:
            return 0.0
        if not 2.0 * self.count_noise_std > noise_multiplier:
            raise PrivacyError(
                f"count_noise_std={self.count_noise_std} is too small for noise_multiplier="
                f"{noise_multiplier}: adaptive clipping needs count_noise_std > noise_multiplier / 2 "
                "so that part of the privacy budget is left for the gradient; raise "
                "count_noise_std (Andrew et al. suggest expected_batch_size / 20).")
        inverse_sq = noise_multiplier ** -2 - (2.0 * self.count_noise_std) ** -2
        return inverse_sq ** -0.5

    def noisy_unclipped_fraction(self, scalar_noise: ScalarNoise,
                                 expected_batch_size: float) -> float:
        """b in [0, 1]: the released centred count (sensitivity 1/2, noise std sigma_b) divided
        by the public expected batch size, plus 1/2."""
        released = self.centred_count + scalar_noise(self.count_noise_std)
        return min(1.0, max(0.0, released / expected_batch_size + 0.5))

    def end_step(self, scalar_noise: ScalarNoise, expected_batch_size: float) -> None:
        fraction = self.noisy_unclipped_fraction(scalar_noise, expected_batch_size)
        self._bound *= math.exp(-self.clipbound_learning_rate
                                * (fraction - self.target_unclipped_quantile))
        self.reset_accumulation()

    def reset_accumulation(self) -> None:
        super().reset_accumulation()
        self.centred_count = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "max_grad_norm": self._bound,
                "centred_count": self.centred_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._bound = float(state["max_grad_norm"])
        self.centred_count = float(state["centred_count"])


CLIPPING_MODES = ("flat", "per_layer", "adaptive")


def make_clipper(clipping: str, max_grad_norm: float | Sequence[float],
                 params: Sequence[nn.Parameter], *, expected_batch_size: float,
                 target_unclipped_quantile: float = 0.5, clipbound_learning_rate: float = 0.2,
                 count_noise_std: float | None = None) -> Clipper:
    """The clipper for `clipping` ("flat" | "per_layer" | "adaptive"), validating its arguments.

    `count_noise_std` (adaptive only) defaults to expected_batch_size / 20 (Andrew et al.).
    """
    if clipping not in CLIPPING_MODES:
        raise ConfigError(f"clipping={clipping!r} is not a clipping mode; use one of "
                          f"{list(CLIPPING_MODES)}.")
    if clipping == "per_layer":
        return PerLayerClipper(max_grad_norm, params)
    if not isinstance(max_grad_norm, (int, float)):
        raise ConfigError(f"max_grad_norm={max_grad_norm!r}: a list of per-layer bounds needs "
                          f"clipping='per_layer' (got clipping={clipping!r}); pass one float.")
    if clipping == "flat":
        return FlatClipper(max_grad_norm)
    if count_noise_std is None:
        count_noise_std = expected_batch_size / 20.0
    return AdaptiveClipper(max_grad_norm, target_unclipped_quantile, clipbound_learning_rate,
                           count_noise_std)
