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

import torch
from torch import Tensor, nn
from torch.nn import functional as F

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

    def token_sums(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(the cross-entropy summed over every counted token of the batch, in nats; the number
        of those tokens), both 0-dim: a split's perplexity is exp(sum of the first / sum of the
        second), the per-token average (not the mean of per-sample means the loss is)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 summed in fp32
        totals = per_sample_token_losses(wide, labels, ignore_index=self.ignore_index,
                                         shift=self.shift, token_reduction="sum")
        counted = labels[:, 1:] if self.shift else labels
        return totals.sum(), (counted != self.ignore_index).sum()
