"""DPOptimizer: the DP-SGD step around any torch.optim optimizer.

Per logical batch: clip each sample's gradient (a `Clipper`), sum the clipped gradients into
`p.summed_grad` (possibly over several physical chunks), add Gaussian noise N(0, sigma^2 S^2)
once (S the clipper's L2 sensitivity), divide by the public `expected_batch_size`, write `p.grad`,
and step the wrapped optimizer (`release`). The step's `Charge` (sigma and the q of the released
batch's record, dptrain.data.batch_record) goes to the charge listeners (the engine's accountant),
then the step hooks run and the schedules advance.

`p.summed_grad` holds the clipped noiseless sum while a logical batch is being accumulated and
while the step hooks run; `step()` clears it before returning (unlike Opacus, which keeps it until
`zero_grad()`): left on the parameters, the noise-free sum would be pickled by `torch.save(model)`
and released with the model. `p.grad` keeps the noisy gradient.

Precision: `p.summed_grad` is kept in `norm_dtype(p)`, float32 for 16-bit (bf16, fp16) parameters,
so that a sum of B contributions each at most C has sensitivity C (a 16-bit accumulator would round
every chunk's sum); the noise is drawn and added in float32 too, and only the noisy gradient is cast
to the parameter's dtype. That cast rounds the released gradient by up to 2^-8 (bf16) or 2^-11
(fp16) of each coordinate: post-processing of the noisy sum, which costs no privacy. The price is
one float32 accumulator per 16-bit parameter (4 bytes per weight) while a logical batch is summed.

Two ways to drive it, one release: a loop that owns the step (`dptrain.privacy.step.private_step`)
clips each chunk (`clip_and_accumulate`) and calls `release(record)` with the record of the batch;
a loop written for a plain optimizer calls `step()` (each physical chunk's, with
`BatchMemoryManager`), which releases the record of the batch the private loader handed out last.
The link to the loader (`follow_loader`, dptrain.privacy.loader_link) refuses the misuse of such a
loop that would make the accountant charge another mechanism than the one run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dptrain.checks import check_noise_multiplier, check_sample_rate
from dptrain.data.batch_record import BatchRecord
from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.ghost_math import norm_dtype
from dptrain.privacy.charge import Charge
from dptrain.privacy.clipping import Clipper, FlatClipper, PerSampleSource
from dptrain.privacy.loader_link import LoaderLink, Unlinked
from dptrain.privacy.noise import NoiseStrategy, check_compatible, strategy_from_dict
from dptrain.randomness import entropy_generator, gaussian_noise
from dptrain.privacy.schedules import Schedule

StepHook = Callable[["DPOptimizer"], None]
ChargeListener = Callable[[Charge], None]

class DPOptimizer(Optimizer):
    """A differentially private wrapper of `optimizer` (shares its param_groups and state).

    Args:
        optimizer: the wrapped torch optimizer; its params must be the module's trainable ones.
        noise_multiplier: sigma, the noise std in units of the clipping sensitivity (>= 0).
        max_grad_norm: C; used to build a FlatClipper when `clipper` is None, otherwise it must
            equal `clipper.max_grad_norm` (or be None).
        expected_batch_size: q * N, the public denominator of the averaged gradient (samples).
        clipper: the clipping strategy (default FlatClipper(max_grad_norm)).
        module: the per-sample gradient source (clipping interface of contract 1).
        sample_rate: q, the Poisson sample rate, read by the accountant hook at every step.
        noise_generator: a seeded torch.Generator for reproducible noise (an explicit opt-in:
            NOT a guarantee if its seed is known). Default None: a generator seeded from OS
            entropy (`dptrain.randomness.entropy_generator`), unpredictable and never saved.
        secure_mode: draw noise from the OS CSPRNG (see dptrain.randomness).
        noise_schedule: Schedule(step) -> sigma, applied from step 0.
        sample_rate_schedule: Schedule(step) -> q, applied from step 0, for an optimizer that
            is not linked to a private loader (the engine gives a schedule to the loader only:
            a released batch's record carries the q it was drawn with).
        noise_strategy: how the noise of the steps is correlated (dptrain.privacy.noise; None:
            Independent, DP-SGD). The i.i.d. draw of each step is made as for independent noise
            and passed through the strategy's generator, whose buffers are part of
            `dp_state_dict`.
    """

    def __init__(self, optimizer: Optimizer, noise_multiplier: float,
                 max_grad_norm: float | None, expected_batch_size: float,
                 clipper: Clipper | None = None, *, module: PerSampleSource, sample_rate: float,
                 noise_generator: torch.Generator | None = None, secure_mode: bool = False,
                 noise_schedule: Schedule | None = None,
                 sample_rate_schedule: Schedule | None = None,
                 noise_strategy: NoiseStrategy | None = None) -> None:
        if isinstance(optimizer, DPOptimizer):
            raise ConfigError("optimizer is already a DPOptimizer: pass the plain torch optimizer.")
        self.original_optimizer = optimizer
        self.module = module
        self.clipper = clipper if clipper is not None else FlatClipper(max_grad_norm)
        if max_grad_norm is not None and clipper is not None and not math.isclose(
                float(max_grad_norm), clipper.max_grad_norm, rel_tol=1e-9):
            raise ConfigError(f"max_grad_norm={max_grad_norm} differs from the clipper's "
                              f"sensitivity {clipper.max_grad_norm}: pass max_grad_norm=None.")
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.sample_rate = check_sample_rate(sample_rate)
        if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
            raise PrivacyError(f"expected_batch_size={expected_batch_size!r} must be > 0 (the "
                               "public sample_rate * dataset size).")
        self.expected_batch_size = float(expected_batch_size)
        self._public_size = self.expected_batch_size / self.sample_rate  # N, public
        self.secure_mode = bool(secure_mode)
        #: True when the noise comes from a caller-seeded generator (replayable from its seed).
        self.reproducible_noise = noise_generator is not None and not self.secure_mode
        self.noise_generator = self._noise_source(noise_generator)
        self.noise_schedule = noise_schedule
        self.sample_rate_schedule = sample_rate_schedule
        self.noise_strategy = strategy_from_dict(noise_strategy)
        check_compatible(self.noise_strategy, noise_schedule=noise_schedule is not None,
                         rate_schedule=sample_rate_schedule is not None,
                         clipping=self.clipper.name)
        #: (C^{-1} Z)_t from the draw Z_t, per parameter (its buffers are resume state)
        self.noise_generator_state = self.noise_strategy.generator()
        self._noise_keys = {id(p): i for i, p in enumerate(self.params)}
        self.steps_taken = 0
        self.last_charge: Charge | None = None  # what the last step charged
        self._step_hooks: list[StepHook] = []
        self._charge_listeners: list[ChargeListener] = []
        #: the loop protocol of a caller's loop that calls `step()` itself: the virtual-step
        #: signals, and, once linked to the private loader (`follow_loader`), its records
        self.link: Unlinked = Unlinked()
        for p in self.params:
            p.summed_grad = None
        self._apply_schedules()

    def _noise_source(self, noise_generator: torch.Generator | None) -> torch.Generator | None:
        """The generator the noise is drawn from: the caller's, none in secure mode, else a fresh
        one seeded from OS entropy on the parameters' device."""
        if self.secure_mode or noise_generator is not None:
            return noise_generator
        params = self.params
        return entropy_generator(params[0].device if params else "cpu")

    # -- shared state with the wrapped optimizer ---------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> defaultdict:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value: defaultdict) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable (requires_grad) parameters of every param group, in order; frozen ones
        get no noise and keep p.grad None."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @property
    def max_grad_norm(self) -> float:
        """The clipping sensitivity C (per-layer: sqrt(sum C_k^2); adaptive: the current C)."""
        return self.clipper.max_grad_norm

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict (the DP state is in `dp_state_dict`)."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm="
                f"{self.max_grad_norm}, clipping={self.clipper.name!r}, expected_batch_size="
                f"{self.expected_batch_size}, secure_mode={self.secure_mode}, "
                f"wrapping={self.original_optimizer!r})")

    # -- the mechanism -----------------------------------------------------------------------
    def attach_step_hook(self, fn: StepHook) -> None:
        """Run fn(optimizer) after every real step (not after skipped virtual steps); while it
        runs, p.grad holds the noisy gradient and p.summed_grad the noise-free clipped sum."""
        self._step_hooks.append(fn)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next `step()` only clip and accumulate (a non-final physical chunk)."""
        self.link.skip_next = bool(do_skip)

    def add_charge_listener(self, fn: ChargeListener) -> None:
        """Call fn(charge) with the `Charge` of every real step (the engine's accountant), before
        the step hooks."""
        self._charge_listeners.append(fn)

    def follow_loader(self, loader: Any, *, one_batch_per_step: bool = False,
                      refuse_at_backward: bool = False) -> None:
        """Link to the private loader (dptrain.privacy.loader_link): from now on every real step
        releases the record of the batch it handed out last, needs a new batch from it, and
        never mixes gradients of two of its batches."""
        skip_next = self.link.skip_next
        self.link = LoaderLink(self, loader, one_batch_per_step=one_batch_per_step,
                               refuse_at_backward=refuse_at_backward)
        self.link.skip_next = skip_next

    def has_pending_sum(self) -> bool:
        """Whether a clipped sum of chunks not yet released is held (`p.summed_grad`)."""
        return any(getattr(p, "summed_grad", None) is not None for p in self.params)

    def clip_and_accumulate(self) -> None:
        """Clip the current chunk's per-sample gradients and add them into `p.summed_grad`
        (in `norm_dtype(p)`: float32 for 16-bit parameters).

        Frees the per-sample state of the source. A chunk with 0 samples adds nothing.
        Raises PrivacyError (discarding the pending gradients) when the chunk would mix rows
        of two logical batches (see the module docstring).
        """
        source = self.module
        if source.per_sample_batch_size() == 0:
            # an empty Poisson batch, or a model left in eval mode: nothing was captured, and
            # its gradients would be dropped while the step released noise alone
            refuse = getattr(source, "refuse_uncaptured_gradients", None)
            if refuse is not None:
                refuse()
            self._clear_per_sample()
            return
        self.link.check_chunk()
        source.check_complete()
        sums = self.clipper.clip(source)
        for p in self.params:
            clipped = sums.get(p)
            if clipped is None:
                continue
            previous = getattr(p, "summed_grad", None)
            p.summed_grad = clipped if previous is None else previous + clipped
        self._clear_per_sample()

    def _clear_per_sample(self) -> None:
        """Free the source's per-sample state (nothing of an earlier batch is pending after)."""
        self.module.clear_per_sample()
        self.link.rows_cleared()

    def refuse(self, reason: str) -> None:
        """Discard everything pending for this step (nothing of it is released), then raise
        PrivacyError with `reason`."""
        self._clear_per_sample()
        self._clear_summed()
        self.clipper.reset_accumulation()
        self.link.skip_next = self.link.last_step_skipped = False
        raise PrivacyError(f"DPOptimizer step {self.steps_taken} refused: {reason}")

    #: Examples of the last real step left out for a gradient that is not finite (a 0-dim tensor
    #: or 0; users at user level; summed over the ranks under DDP and FSDP): a statistic of the
    #: training data that epsilon does not cover, for the private metrics only.
    excluded_examples: Tensor | int = 0

    def _combine_clipped_sums(self, sums: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """The reduction point between clipping and noise: identity on one process.

        A distributed subclass all-reduces (sums) the clipped sums of every rank here, so that the
        noise below is added once to the global sum. Returns {p: Tensor[*p.shape]}.
        """
        return sums

    def _gradient_noise_std(self) -> float:
        """Std of the noise on the clipped gradient sum, in gradient units: sigma_grad * S."""
        return self.clipper.gradient_noise_multiplier(self.noise_multiplier) * self.clipper.max_grad_norm

    def _noise(self, p: nn.Parameter, std: float) -> Tensor:
        """The noise for parameter `p` at this step: the i.i.d. draw N(0, std^2) of p's shape in
        float32/64 on p's device, passed through the noise strategy's generator ((C^{-1} Z)_t;
        independent noise: the draw itself). A fresh tensor the caller may write into."""
        key = self._noise_keys.setdefault(id(p), len(self._noise_keys))
        return self.noise_generator_state(key, self._noise_draw(p, std))

    def _noise_draw(self, p: nn.Parameter, std: float) -> Tensor:
        """The i.i.d. draw Z_t for `p`: N(0, std^2) of p's shape, float32 (float64 for float64
        parameters), on p's device, from the noise generator or the OS CSPRNG."""
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        return gaussian_noise(p.shape, std, self.noise_generator, self.secure_mode,
                              device=p.device, dtype=dtype)

    def _scalar_noise(self, std: float) -> float:
        """One N(0, std^2) draw from the same source as the gradient noise (adaptive count)."""
        return float(gaussian_noise((1,), std, self.noise_generator, self.secure_mode,
                                    dtype=torch.float64)[0])

    def _write_noisy_gradients(self) -> None:
        """p.grad = (combined clipped sum + N(0, (sigma_grad * S)^2)) / expected_batch_size.

        The noise is drawn at std sigma_grad * S / expected_batch_size straight into the buffer
        that becomes p.grad, and the clipped sum is added into it scaled by 1 / expected_batch_size
        (one pass, no temporaries): beside the clipped sums, the step allocates one buffer per
        parameter (two for 16-bit parameters, whose noise is drawn and added in float32, to the
        float32 clipped sum, and the result then cast to the parameter's dtype).
        """
        params = self.params
        sums = {p: p.summed_grad if getattr(p, "summed_grad", None) is not None
                else torch.zeros_like(p, dtype=norm_dtype(p)) for p in params}
        combined = self._combine_clipped_sums(sums)
        scale = 1.0 / self.expected_batch_size
        std = self._gradient_noise_std() * scale
        for p in params:
            p.summed_grad = combined[p]
            grad = self._noise(p, std).add_(combined[p], alpha=scale)
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Clip and accumulate the current chunk, then release the logical batch (`release`:
        the batch the private loader handed out last), or, after `signal_skip_step(True)`, only
        clip and accumulate (a non-final physical chunk).

        `closure`, if given, is run first with gradients enabled (forward + backward).
        Returns the closure's loss, else the wrapped optimizer's return value.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clip_and_accumulate()
        if self.link.skip_next:
            self.link.skip_next, self.link.last_step_skipped = False, True
            return loss
        self.link.last_step_skipped = False
        result = self._release(None, None)[1]
        return loss if closure is not None else result

    def release(self, record: BatchRecord | None = None,
                batch_size: int | None = None) -> Charge:
        """Noise the clipped sum accumulated for one logical batch, step the wrapped optimizer
        once and charge the step: returns its `Charge` (also `last_charge`, and given to the
        charge listeners).

        `record` is the record of the released batch (dptrain.data.batch_record): q and the
        expected batch size q * N are its. Linked to a private loader, it must be the batch
        handed out last (None: that one); unlinked, None means the optimizer's own q (the plan's
        or the sample-rate schedule's). `batch_size`: the rows the caller trained on (None: the
        record's).
        """
        return self._release(record, batch_size)[0]

    def _release(self, record: BatchRecord | None,
                 batch_size: int | None) -> tuple[Charge, Any]:
        """`release`, with the wrapped optimizer's return value."""
        record = self.link.record_to_release(record)
        if record is not None:
            self.sample_rate = check_sample_rate(record.sample_rate, "the batch record's q")
            self.expected_batch_size = self.sample_rate * self._public_size
        try:
            self.excluded_examples = self.clipper.pop_excluded()  # (ranks: summed when combined)
            self._write_noisy_gradients()
            result = self.original_optimizer.step()
            charge = Charge(noise_multiplier=float(self.noise_multiplier),
                            sample_rate=float(self.sample_rate),
                            batch_size=batch_size if batch_size is not None else (
                                None if record is None else record.size),
                            step=self.steps_taken,
                            batch_index=None if record is None else record.index)
            self.last_charge = charge
            for listener in self._charge_listeners:
                listener(charge)
            for hook in self._step_hooks:
                hook(self)
        finally:
            self._clear_summed()  # the noise-free sum never outlives the step
        self.link.released()
        self.clipper.end_step(self._scalar_noise, self.expected_batch_size)
        self.steps_taken += 1
        self._apply_schedules()
        return charge, result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear p.grad, the per-sample state and p.summed_grad (kept after a skipped step)."""
        self._clear_per_sample()
        if not self.link.last_step_skipped:
            self._clear_summed()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def discard_partial_batch(self) -> None:
        """Forget an unfinished logical batch: the clipped sums accumulated by skipped steps,
        pending per-sample gradients and skip signals (nothing of it is ever released)."""
        if self.link.last_step_skipped or self.has_pending_sum():
            self._clear_summed()
            self.clipper.reset_accumulation()
            self.link.last_step_skipped = False
        self.link.skip_next = False
        self._clear_per_sample()

    def _clear_summed(self) -> None:
        for p in self.params:
            p.summed_grad = None
        self.link.sum_cleared()

    # -- schedules and state -----------------------------------------------------------------
    def _apply_schedules(self) -> None:
        """Set sigma, q and the expected batch size for step `steps_taken` from the schedules."""
        step = self.steps_taken
        if self.noise_schedule is not None:
            self.noise_multiplier = check_noise_multiplier(
                self.noise_schedule(step), f"noise_schedule (value at step {step})")
        if self.sample_rate_schedule is not None:
            self.sample_rate = check_sample_rate(
                self.sample_rate_schedule(step), f"sample_rate_schedule (value at step {step})")
            self.expected_batch_size = self.sample_rate * self._public_size

    def dp_state_dict(self) -> dict[str, Any]:
        """The DP state to resume exactly: step count, current sigma/q, clipper state, and the
        correlated-noise buffers (exact CPU copies; empty for independent noise)."""
        return {"steps_taken": self.steps_taken, "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "expected_batch_size": self.expected_batch_size,
                "clipper": self.clipper.state_dict(),
                "noise_strategy": self.noise_strategy.to_dict(),
                "noise_buffers": self.noise_generator_state.state_dict()}

    def load_dp_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `dp_state_dict`; ConfigError when it holds another noise strategy's
        buffers (a state without any, written before noise strategies existed, is independent)."""
        recorded = strategy_from_dict(state.get("noise_strategy"))
        if recorded != self.noise_strategy:
            raise ConfigError(f"the saved DP state was made with the noise strategy "
                              f"{recorded.to_dict()}, not this optimizer's "
                              f"{self.noise_strategy.to_dict()}: its noise buffers cannot continue "
                              "this run. Resume with the same privacy.noise settings.")
        if state.get("noise_buffers") is not None:
            self.noise_generator_state.load_state_dict(state["noise_buffers"])
        self.clipper.load_state_dict(state["clipper"])
        self.steps_taken = int(state["steps_taken"])
        self.noise_multiplier = float(state["noise_multiplier"])
        self.sample_rate = float(state["sample_rate"])
        self.expected_batch_size = float(state["expected_batch_size"])
        self._apply_schedules()
        self.link.restored()
