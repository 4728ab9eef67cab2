"""Canaries for a one-run audit: which are included, how they enter the run, how they are scored.

Each of m canaries is included independently with probability 1/2 (`draw_inclusion`); after the
run every canary gets a score (higher: more likely included), from which `dptrain.audit.result`
makes guesses and `dptrain.audit.bound` the lower bound.

White box (`DiracCanaries`): canary i is a per-sample gradient A * e_{j_i}, zero except on its
own coordinate j_i of the trainable parameters (a Dirac canary), with A = `norm_multiplier` * C.
In every step an included canary joins the batch with the run's sample rate q, as a
Poisson-sampled example would (but not in a step whose batch is empty), and enters through the
clipping interface of contract 1 as one more per-sample gradient: the run's own clipper scales
it to norm C (a clipper that does not clip leaves it at A, which the audit then sees) and it
lands in the clipped sum before the noise. Nothing of the shipped optimizer changes: the
canaries wrap `optimizer.module`, the per-sample gradient source the DP optimizer reads. Scores
are computed from the parameter updates on the canary coordinates,
x_t = theta_t[j] - theta_{t+1}[j] (a present canary pushes its coordinate down):

* `last_iterate`: theta_0[j] - theta_T[j], what the final model alone reveals;
* `all_iterates`: sum_t log(1 - q_t + q_t exp(mu z_t - mu^2 / 2)), the log-likelihood ratio of
  "the canary was sampled with probability q_t" against "never present", where z_t is x_t
  standardised across the canary coordinates of that step (median, and 1.4826 * the median
  absolute deviation) and mu = 1 / sigma the claimed signal-to-noise ratio of one clipped
  gradient. Any score gives a valid bound; this one is the likelihood-ratio test of the claimed
  subsampled Gaussian mechanism, step by step.

Black box (`MislabeledCanaries`): m training examples whose labels are changed to another class;
the excluded ones are removed from the training set. The score of a canary is minus the trained
model's loss on it (with its changed label).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from dptrain.batches import inputs_and_targets, to_device, with_targets
from dptrain.errors import ConfigError
from dptrain.losses import LossStep, ModelLoss, step_losses
from dptrain.privacy.clipping import PerSampleSource
from dptrain.randomness import derive_seeds, make_generator

WHITE_BOX_SCORES = ("all_iterates", "last_iterate")
_MAD_TO_STD = 1.4826  # 1 / Phi^-1(3/4): the median absolute deviation of N(0, 1) is 1 / 1.4826


def check_canary_count(canaries: Any, limit: int, what: str, argument: str) -> int:
    """`canaries` as an int in [1, limit], else ConfigError naming `argument` and the limit."""
    if isinstance(canaries, bool) or not isinstance(canaries, (int, np.integer)) or canaries < 1:
        raise ConfigError(f"{argument}={canaries!r} must be a positive number of canaries (m, "
                          "e.g. 1000).")
    if canaries > limit:
        raise ConfigError(f"{argument}={canaries} is more canaries than {what} allows ({limit}): "
                          f"use at most {limit}.")
    return int(canaries)


def check_same_canaries(state: dict[str, Any], kind: str, count: int) -> None:
    """ConfigError unless a saved canary state is of `kind` with `count` canaries."""
    if state.get("kind") != kind or int(state.get("count", -1)) != count:
        raise ConfigError(f"the checkpoint's canaries ({state.get('kind')}, {state.get('count')} "
                          f"canaries) are not this audit's ({kind}, {count}): resume with the "
                          "same audit.kind and audit.canaries.")


def draw_inclusion(canaries: int, generator: torch.Generator) -> Tensor:
    """S: Tensor[m] bool, each canary included independently with probability 1/2."""
    return torch.rand(canaries, generator=generator, dtype=torch.float64) < 0.5


# -- white box -------------------------------------------------------------------------------
class _CanarySource:
    """A per-sample gradient source (contract 1) that adds the canaries present in this step.

    Wraps the source the DP optimizer reads. In each logical step, the first chunk the optimizer
    clips that holds real samples also holds one extra per-sample gradient for every canary
    present in the step (drawn lazily, once per step); the canaries' rows come after the real
    samples. A step without any real sample (an empty Poisson batch) carries no canary: each
    canary then takes part in a step with probability at most q, so the audit stays valid.
    """

    def __init__(self, inner: PerSampleSource, canaries: "DiracCanaries") -> None:
        self.inner = inner
        self._canaries = canaries
        self._present: Tensor | None = None   # canary ids present in the current step
        self._delivered = False               # their rows went into this step's clipped sum

    # the contract-1 interface ---------------------------------------------------------------
    def per_sample_batch_size(self) -> int:
        real = self.inner.per_sample_batch_size()
        return real + len(self._pending()) if real else 0

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        pending = self._pending()
        return {p: torch.cat([sq, self._canaries.squared_rows(p, pending).to(sq.dtype)])
                for p, sq in self.inner.squared_norms().items()}

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        real = self.inner.per_sample_batch_size()
        pending = self._pending()
        sums = self.inner.weighted_sum({p: w[:real] for p, w in weights.items()})
        self._delivered = True
        return {p: self._canaries.add_rows(total, p, pending, weights[p][real:])
                for p, total in sums.items()}

    def clear_per_sample(self) -> None:
        self.inner.clear_per_sample()

    def check_complete(self) -> None:
        self.inner.check_complete()

    # step bookkeeping -----------------------------------------------------------------------
    def _pending(self) -> Tensor:
        if self._delivered:
            return self._canaries.no_canary
        if self._present is None:
            self._present = self._canaries.draw_present()
        return self._present

    def end_step(self) -> Tensor:
        """The ids of the canaries in the step just released; starts the next step (whose
        canaries are drawn when first asked for)."""
        present = self._present if self._delivered and self._present is not None \
            else self._canaries.no_canary
        self._present, self._delivered = None, False
        return present

    def __getattr__(self, name: str) -> Any:  # everything else of the wrapped module
        return getattr(self.inner, name)


class DiracCanaries:
    """White-box Dirac gradient canaries in a run made by `make_private` (see module doc).

    Create it after `make_private` and before training; it attaches itself to the optimizer.

    Args:
        optimizer: the DPOptimizer returned by `make_private` (one process).
        canaries: m, at most the number of trainable coordinates.
        seed: seeds the canary coordinates, the inclusion S and the per-step sampling of the
            canaries (independent of the run's own noise and sampling).
        norm_multiplier: A / C, the canary gradient's norm before clipping, in units of the
            clipping norm C (>= 1; a correct clipper scales it to C).
    """

    def __init__(self, optimizer: Any, canaries: int, *, seed: int = 0,
                 norm_multiplier: float = 10.0) -> None:
        from dptrain.distributed.runtime import get_world_size
        from dptrain.privacy.optimizer import DPOptimizer

        if not isinstance(optimizer, DPOptimizer):
            raise ConfigError(f"optimizer must be the DPOptimizer made by make_private, got "
                              f"{type(optimizer).__name__}: a white-box audit inserts its canaries "
                              "into the DP optimizer's clipped sum.")
        if get_world_size() > 1:
            raise ConfigError("a white-box audit runs in one process: under torch.distributed "
                              "every rank would add the canaries. Audit a single-process run.")
        if not (isinstance(norm_multiplier, (int, float)) and norm_multiplier >= 1):
            raise ConfigError(f"norm_multiplier={norm_multiplier!r} must be >= 1 (the canary "
                              "gradient's norm in units of the clipping norm).")
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = list(optimizer.params)
        self._param_index = {id(p): k for k, p in enumerate(self.params)}
        sizes = [p.numel() for p in self.params]
        self.count = check_canary_count(canaries, sum(sizes), "the model's trainable coordinates",
                                        "canaries")
        self.norm_multiplier = float(norm_multiplier)
        coords_seed, inclusion_seed, sampling_seed = derive_seeds(seed, 3)
        self.coordinates = torch.randperm(sum(sizes), generator=make_generator(coords_seed))[
            : self.count]
        self.included = draw_inclusion(self.count, make_generator(inclusion_seed))
        self._sampling = make_generator(sampling_seed)
        offsets = torch.tensor([0] + sizes).cumsum(0)
        owner = torch.searchsorted(offsets, self.coordinates, right=True) - 1  # param index
        self._owner = owner
        self._local = self.coordinates - offsets[owner]                      # index inside it
        self.no_canary = torch.zeros(0, dtype=torch.int64)
        self.initial = self._coordinate_values()
        self._previous = self.initial.clone()
        self.llr = torch.zeros(self.count, dtype=torch.float64)
        self.steps = 0
        self.step_sample_rate = float(optimizer.sample_rate)  # q of the last step's canary draw
        self.last_present = self.no_canary                    # canary ids in the last step
        self.source = _CanarySource(optimizer.module, self)
        optimizer.module = self.source
        optimizer.attach_step_hook(self._observe)

    # rows of the canaries present in a step --------------------------------------------------
    def draw_present(self) -> Tensor:
        """Ids of the included canaries that join this step's batch (each with probability q)."""
        self.step_sample_rate = self._sample_rate()
        coins = torch.rand(self.count, generator=self._sampling, dtype=torch.float64)
        return torch.nonzero(self.included & (coins < self.step_sample_rate)).flatten()

    def _sample_rate(self) -> float:
        """q of the batch being released (what a real example was sampled with: the optimizer
        takes it from the private loader when the batch is handed out)."""
        return float(self.optimizer.sample_rate)

    def _norm(self) -> float:
        return self.norm_multiplier * self.optimizer.max_grad_norm

    def squared_rows(self, p: nn.Parameter, present: Tensor) -> Tensor:
        """Tensor[len(present)]: each present canary's squared gradient norm on parameter p."""
        index = self._param_index.get(id(p), -1)  # -1: no canary lives on p
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        own = (self._owner[present] == index).to(device=p.device, dtype=dtype)
        return own * self._norm() ** 2

    def add_rows(self, total: Tensor, p: nn.Parameter, present: Tensor, weights: Tensor) -> Tensor:
        """total + sum_k weights[k] * A * e_{j_k} over the present canaries on p (a new tensor
        where a canary lands on p; `total` itself is never modified)."""
        mine = self._owner[present] == self._param_index.get(id(p), -1)
        if not bool(mine.any()):
            return total
        local = self._local[present[mine]].to(total.device)
        values = weights[mine.to(weights.device)].to(total.dtype) * self._norm()
        return total.reshape(-1).index_add(0, local, values).view_as(total)

    # observation after each step ---------------------------------------------------------------
    def _coordinate_values(self) -> Tensor:
        """theta at the canary coordinates: Tensor[m] float64."""
        flat = [p.detach().reshape(-1) for p in self.params]
        values = torch.empty(self.count, dtype=torch.float64)
        for index, tensor in enumerate(flat):
            mine = self._owner == index
            if mine.any():
                values[mine] = tensor[self._local[mine].to(tensor.device)].double().cpu()
        return values

    def _observe(self, optimizer: Any) -> None:
        """Step hook: accumulate every canary's log-likelihood ratio of this step's update."""
        self.last_present = self.source.end_step()
        current = self._coordinate_values()
        update = self._previous - current
        self._previous = current
        self.steps += 1
        self.llr += step_log_likelihood_ratio(update, self.step_sample_rate,
                                              self._signal_to_noise(optimizer))

    @staticmethod
    def _signal_to_noise(optimizer: Any) -> float:
        """mu = 1 / sigma_grad: a clipped canary's mean shift in units of the noise std."""
        sigma = optimizer.clipper.gradient_noise_multiplier(optimizer.noise_multiplier)
        return math.inf if sigma == 0 else 1.0 / sigma

    def scores(self, score: str = "all_iterates") -> np.ndarray:
        """float64 [m]: each canary's score (higher: more likely included)."""
        if score not in WHITE_BOX_SCORES:
            raise ConfigError(f"score={score!r} is not a white-box score; use one of "
                              f"{list(WHITE_BOX_SCORES)}.")
        if score == "last_iterate":
            return (self.initial - self._coordinate_values()).numpy()
        return self.llr.numpy().copy()

    # resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the audit after a resume (no tensors of the model)."""
        return {"kind": "white_box", "count": self.count, "coordinates": self.coordinates,
                "included": self.included, "sampling": self._sampling.get_state(),
                "initial": self.initial, "previous": self._previous, "llr": self.llr,
                "steps": self.steps, "norm_multiplier": self.norm_multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_canaries(state, "white_box", self.count)
        if not torch.equal(state["coordinates"], self.coordinates):
            raise ConfigError("the checkpoint's canary coordinates differ from this audit's: "
                              "resume with the same audit.seed and model.")
        self.included = state["included"].clone()
        self._sampling.set_state(state["sampling"])
        self.initial, self._previous = state["initial"].clone(), state["previous"].clone()
        self.llr, self.steps = state["llr"].clone(), int(state["steps"])
        self.norm_multiplier = float(state["norm_multiplier"])


def step_log_likelihood_ratio(update: Tensor, sample_rate: float, mu: float) -> Tensor:
    """Per canary: log(1 - q + q exp(mu z - mu^2 / 2)), z the standardised update.

    `update`: Tensor[m] float64, x_t per canary coordinate. z = (x - median) / (1.4826 MAD)
    across the m coordinates (the noise has the same std on every coordinate; the few present
    canaries barely move the median and the MAD). With mu = inf (no noise), z itself.
    """
    centred = update - update.median()
    scale = _MAD_TO_STD * centred.abs().median()
    if not scale > 0:
        scale = centred.abs().max().clamp(min=torch.finfo(torch.float64).tiny)
    z = centred / scale
    if math.isinf(mu):
        return z
    shifted = math.log(sample_rate) + mu * z - 0.5 * mu * mu
    if sample_rate >= 1.0:
        return shifted
    return torch.logaddexp(torch.full_like(z, math.log1p(-sample_rate)), shifted)


# -- black box -------------------------------------------------------------------------------
class _RelabelledSubset(Dataset):
    """`base[indices[k]]` with its label replaced by `labels[k]` where `relabel[k]`."""

    def __init__(self, base: Dataset, indices: Tensor, labels: Tensor, relabel: Tensor) -> None:
        self.base, self.indices, self.labels, self.relabel = base, indices, labels, relabel

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> Any:
        item = self.base[int(self.indices[k])]
        label = self.labels[k] if self.relabel[k] else torch.as_tensor(inputs_and_targets(item)[1])
        return with_targets(item, label)


class MislabeledCanaries:
    """Black-box input canaries: m training examples with a changed label (see module doc).

    Args:
        dataset: the training set, a map-style dataset of (input, integer label) pairs.
        canaries: m, at most len(dataset).
        num_classes: K >= 2; a canary's label becomes one of the K - 1 other classes.
        seed: seeds which examples are canaries, their labels and the inclusion S.

    Train on `training_set()` (the non-canary examples and the included canaries, relabelled);
    then `scores(model)`.
    """

    def __init__(self, dataset: Dataset, canaries: int, *, num_classes: int, seed: int = 0) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        self.count = check_canary_count(canaries, size, "the training set", "canaries")
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ConfigError(f"num_classes={num_classes!r} must be >= 2 to mislabel a canary.")
        choice_seed, label_seed, inclusion_seed = derive_seeds(seed, 3)
        self.dataset = dataset
        self.indices = torch.randperm(size, generator=make_generator(choice_seed))[: self.count]
        original = torch.stack([torch.as_tensor(inputs_and_targets(dataset[int(i)])[1])
                                for i in self.indices])
        shift = torch.randint(1, num_classes, (self.count,), generator=make_generator(label_seed))
        self.labels = (original.to(torch.int64) + shift) % num_classes
        self.included = draw_inclusion(self.count, make_generator(inclusion_seed))

    def training_set(self) -> Dataset:
        """The examples to train on: every non-canary one, then the included canaries relabelled.

        An `ArrayDataset` stays an `ArrayDataset` (vectorised batches); other datasets are wrapped.
        """
        from dptrain.data.datasets.base import ArrayDataset

        size = len(self.dataset)  # type: ignore[arg-type]
        is_canary = torch.zeros(size, dtype=torch.bool)
        is_canary[self.indices] = True
        keep = torch.nonzero(~is_canary).flatten()
        rows = torch.cat([keep, self.indices[self.included]])
        relabel = torch.cat([torch.zeros(len(keep), dtype=torch.bool),
                             torch.ones(int(self.included.sum()), dtype=torch.bool)])
        labels = torch.cat([torch.zeros(len(keep), dtype=torch.int64), self.labels[self.included]])
        if isinstance(self.dataset, ArrayDataset):
            merged = self.dataset.labels[rows].clone()
            merged[relabel] = labels[relabel]
            return type(self.dataset)(self.dataset.features[rows], merged, self.dataset.transform)
        return _RelabelledSubset(self.dataset, rows, labels, relabel)

    @torch.no_grad()
    def scores(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
               batch_size: int = 256, device: torch.device | str | None = None,
               loss_step: LossStep | None = None) -> np.ndarray:
        """float64 [m]: minus the model's loss on each canary with its changed label.

        The canaries' items are collated as a batch (`(x, y)` or a mapping with `labels`:
        `dptrain.batches`) with their changed labels; `loss_step(model, batch)` (a run's
        `TrainingJob.step_loss`) or else `loss_fn(outputs, labels)` must return one loss per
        example (default: cross-entropy with reduction="none"). The model is evaluated in eval
        mode and put back in its mode after.
        """
        if loss_step is None:
            loss_step = ModelLoss(loss_fn or (lambda out, y: nn.functional.cross_entropy(
                out, y, reduction="none")))
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        was_training = model.training
        model.eval()
        losses = []
        try:
            for start in range(0, self.count, batch_size):
                rows = self.indices[start: start + batch_size]
                batch = default_collate([self.dataset[int(i)] for i in rows])
                batch = to_device(with_targets(batch, self.labels[start: start + batch_size]),
                                  torch.device(device))
                losses.append(step_losses(loss_step, model, batch).losses.double().cpu())
        finally:
            model.train(was_training)
        clear = getattr(model, "clear_per_sample", None)
        if callable(clear):
            clear()
        return (-torch.cat(losses)).numpy()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "black_box", "count": self.count, "indices": self.indices,
                "labels": self.labels, "included": self.included}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_canaries(state, "black_box", self.count)
        self.indices, self.labels = state["indices"].clone(), state["labels"].clone()
        self.included = state["included"].clone()
