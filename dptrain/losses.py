"""Losses over tokens with "one sample, one loss" semantics (causal LMs, token classification).

DP-SGD clips each sample's gradient, so the loss must be a sum (or mean) over samples of losses
that each depend on ONE sample: ``loss = (1/B) sum_i L_i`` with ``loss_reduction="mean"``. For a
sequence model, ``L_i`` is the mean (or sum) of the cross-entropy over sample i's own tokens,
padding excluded.

Hugging Face's built-in loss (``model(input_ids, labels=labels).loss``) is instead the mean over
ALL tokens of the batch: sample i's share is ``n_i / sum_j n_j`` of its token sum, a weight that
depends on the other samples' lengths. Its "per-sample gradient" is then not the gradient of a
loss of sample i alone, and the sensitivity the accountant assumes no longer bounds the change of
one sample. Use :func:`token_loss` (or :class:`TokenLoss`) on the logits instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dptrain.batches import call_model, inputs_and_targets, rows
from dptrain.errors import ConfigError

# The label of positions without loss (padding, prompt tokens): Hugging Face's convention.
IGNORE_INDEX = -100

REDUCTIONS = ("mean", "sum")


def _check_reduction(argument: str, value: str) -> None:
    if value not in REDUCTIONS:
        raise ConfigError(f"{argument}={value!r} is not supported: use 'mean' or 'sum'.")


def per_sample_token_losses(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
    token_reduction: str = "mean",
) -> Tensor:
    """Each sample's own loss ``L_i``, ``[B]``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; the cross-entropy is taken in it).
        labels: ``[B, T]`` token ids, ``ignore_index`` at positions that carry no loss (padding,
            prompt tokens).
        ignore_index: the label value of positions without loss (HF's convention: -100).
        shift: True for a causal LM given ``labels = input_ids``: position t predicts token t+1
            (``logits[:, :-1]`` against ``labels[:, 1:]``), as HF's own loss does. False when the
            labels are already aligned with the logits (token classification).
        token_reduction: ``"mean"`` (over the sample's counted tokens; 0 for a sample with none) or
            ``"sum"``.
    """
    _check_reduction("token_reduction", token_reduction)
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ConfigError(
            f"token_loss(logits, labels) needs logits [B, T, V] and labels [B, T]; got logits of "
            f"shape {tuple(logits.shape)} and labels of shape {tuple(labels.shape)}."
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=ignore_index, reduction="none")
    totals = per_token.sum(dim=1)  # [B]; ignored positions contribute 0
    if token_reduction == "sum":
        return totals
    counts = (labels != ignore_index).sum(dim=1).clamp(min=1)
    return totals / counts.to(totals.dtype)


def token_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = True,
    token_reduction: str = "mean",
    reduction: str = "mean",
) -> Tensor:
    """The batch loss ``mean_i L_i`` (``reduction="mean"``) or ``sum_i L_i`` (``"sum"``).

    Pass the same ``reduction`` to ``make_private(loss_reduction=...)``. Arguments as
    :func:`per_sample_token_losses`.
    """
    _check_reduction("reduction", reduction)
    losses = per_sample_token_losses(
        logits, labels, ignore_index=ignore_index, shift=shift, token_reduction=token_reduction
    )
    return losses.mean() if reduction == "mean" else losses.sum()


class TokenLoss(nn.Module):
    """:func:`token_loss` as a loss module; ``reduction`` is readable like torch's losses'."""

    def __init__(
        self, ignore_index: int = IGNORE_INDEX, shift: bool = True, token_reduction: str = "mean", reduction: str = "mean"
    ) -> None:
        super().__init__()
        _check_reduction("token_reduction", token_reduction)
        _check_reduction("reduction", reduction)
        self.ignore_index, self.shift = ignore_index, shift
        self.token_reduction, self.reduction = token_reduction, reduction

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return token_loss(
            logits,
            labels,
            ignore_index=self.ignore_index,
            shift=self.shift,
            token_reduction=self.token_reduction,
            reduction=self.reduction,
        )

    def per_sample(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Each sample's own loss ``L_i``, ``[B]`` (:func:`per_sample_token_losses` with this
        loss's settings): what a loss step averages."""
        return per_sample_token_losses(logits, labels, ignore_index=self.ignore_index,
                                       shift=self.shift, token_reduction=self.token_reduction)

    def token_sums(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(the cross-entropy summed over every counted token of the batch, in nats; the number
        of those tokens), both 0-dim: a split's perplexity is exp(sum of the first / sum of the
        second), the per-token average (not the mean of per-sample means the loss is)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 summed in fp32
        totals = per_sample_token_losses(wide, labels, ignore_index=self.ignore_index,
                                         shift=self.shift, token_reduction="sum")
        counted = labels[:, 1:] if self.shift else labels
        return totals.sum(), (counted != self.ignore_index).sum()


# ----------------------------------------------------------------------------- loss steps
class StepLosses(NamedTuple):
    """What a loss step computed on a batch of B examples: `losses` `[B]`, each example's own
    loss; and, for the training accuracy, the evaluation's accuracy and a perplexity, the
    model's `output` (logits `[B, K]` or `[B, T, V]`) and the `target` it was scored against
    (None when the step does not give them: no accuracy is reported then)."""

    losses: Tensor
    output: Any = None
    target: Tensor | None = None


# loss_step(model, batch) -> Tensor[B] (each example's loss), or StepLosses
LossStep = Callable[[nn.Module, Any], Union[Tensor, StepLosses]]
BatchLoss = Callable[[Tensor, Tensor], Tensor]  # loss_fn(output, target) -> the batch's loss


def per_example_losses(loss_fn: BatchLoss, output: Tensor, target: Tensor) -> Tensor:
    """`[B]`: each example's loss under `loss_fn` when its per-example form is known
    (`F.cross_entropy`: reduction none; a loss with a `per_sample(output, target)` method, as
    :class:`TokenLoss`, averaging over examples), else `loss_fn(output, target)` itself: the
    batch's mean loss (0-dim) of a loss function written for the earlier contract, which the
    loop uses as the mean of its examples' losses, as before."""
    if getattr(loss_fn, "reduction", "mean") == "mean":
        per_sample = getattr(loss_fn, "per_sample", None)
        if callable(per_sample):
            return per_sample(output, target)
        if loss_fn is F.cross_entropy and output.dim() == 2 and target.dim() <= 2:
            return F.cross_entropy(output, target, reduction="none")
    return loss_fn(output, target)


class ModelLoss:
    """The default loss step: `model(x)` (or `model(**inputs)` for a mapping batch, its
    `labels` taken out: :func:`dptrain.batches.inputs_and_targets`), then `loss_fn(output,
    targets)` per example (:func:`per_example_losses`; default: cross-entropy with reduction
    none). `token_sums` is the loss function's, when it has one (a perplexity)."""

    def __init__(self, loss_fn: BatchLoss | None = None) -> None:
        self.loss_fn = F.cross_entropy if loss_fn is None else loss_fn
        sums = getattr(self.loss_fn, "token_sums", None)
        if callable(sums):
            self.token_sums = sums

    def __call__(self, model: nn.Module, batch: Any) -> StepLosses:
        inputs, target = inputs_and_targets(batch)
        output = call_model(model, inputs)
        return StepLosses(per_example_losses(self.loss_fn, output, target), output, target)

    def __repr__(self) -> str:
        return f"ModelLoss({getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)})"


def step_losses(loss_step: LossStep, model: nn.Module, batch: Any) -> StepLosses:
    """`loss_step(model, batch)` as StepLosses, checked: one loss per example of the batch
    (`[B]`; a 0-dim batch loss only from :class:`ModelLoss` over a loss function of the earlier
    contract). ConfigError naming the loss step otherwise: a batch loss cannot be told apart
    per example, and the loop must average each example's own loss."""
    result = loss_step(model, batch)
    out = result if isinstance(result, StepLosses) else StepLosses(result)
    losses = out.losses
    size = rows(batch)
    legacy = isinstance(loss_step, ModelLoss) and isinstance(losses, Tensor) and losses.dim() == 0
    if not legacy and not (isinstance(losses, Tensor) and losses.dim() == 1
                           and (size is None or losses.shape[0] == size)):
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ConfigError(
            f"loss_step={loss_step!r} returned losses of shape {shape} for a batch of {size} "
            f"examples: it must return one loss per example, a Tensor[B] (e.g. "
            f"F.cross_entropy(output, target, reduction='none')), which the loop averages.")
    return out
