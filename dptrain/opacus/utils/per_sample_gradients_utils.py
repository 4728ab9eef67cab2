"""Opacus's ``opacus.utils.per_sample_gradients_utils.check_per_sample_gradients_are_correct``
on dptrain's check (dptrain.grad_sample.check): the per-sample gradients of one batched pass
against each sample run alone."""

from __future__ import annotations

import torch
from torch import nn

from dptrain.grad_sample.check import microbatch_grad_samples, wrapped_grad_samples
from dptrain.opacus._absent import absent
from dptrain.opacus.utils.module_utils import clone_module


def check_per_sample_gradients_are_correct(x: torch.Tensor, module: nn.Module, *,
                                           batch_first: bool = True, atol: float = 10e-6,
                                           rtol: float = 10e-5,
                                           grad_sample_mode: str = "hooks") -> bool:
    """Whether dptrain's per-sample gradients of `module` for the batch `x` (batch at dim 0, or
    dim 1 with batch_first=False) match, within torch.allclose(atol, rtol), the gradients of
    each sample run alone, under Opacus's loss (L1 distance of the output to zeros) reduced by
    "sum" and by "mean". `grad_sample_mode` is accepted; dptrain's hooks compute them."""
    with torch.no_grad():
        targets = torch.zeros_like(module(x))
    if not batch_first:
        targets = targets.transpose(0, 1)
    for reduction in ("sum", "mean"):
        loss = _opacus_loss(nn.L1Loss(reduction=reduction), batch_first)
        truth = microbatch_grad_samples(module, x, targets, loss, batch_first)
        ours = wrapped_grad_samples(module, x, targets, loss, batch_first, reduction)
        if any(ours[name].shape != expected.shape
               or not torch.allclose(ours[name], expected, atol=atol, rtol=rtol)
               for name, expected in truth.items()):
            return False
    return True


def _opacus_loss(criterion: nn.L1Loss, batch_first: bool):  # type: ignore[no-untyped-def]
    """criterion(output, target), the target given batch first (as dptrain's check gives it)."""
    if batch_first:
        return criterion
    return lambda output, target: criterion(output, target.transpose(0, 1))


_CHECK = ("check_per_sample_gradients_are_correct(x, module) (dptrain.grad_sample.check "
          "compares a batched pass with each sample run alone)")
_HERE = "opacus.utils.per_sample_gradients_utils"
is_batch_empty = absent(f"{_HERE}.is_batch_empty", _CHECK)
ModelWithLoss = absent(f"{_HERE}.ModelWithLoss", _CHECK)
compute_microbatch_grad_sample = absent(f"{_HERE}.compute_microbatch_grad_sample", _CHECK)
compute_opacus_grad_sample = absent(f"{_HERE}.compute_opacus_grad_sample", _CHECK)
check_torch_version_for_ew_sample = absent(f"{_HERE}.check_torch_version_for_ew_sample", _CHECK)
get_grad_sample_modes = absent(f"{_HERE}.get_grad_sample_modes", _CHECK)
compute_microbatch_grad_sample_tensor_or_seq = absent(f"{_HERE}.compute_microbatch_grad_sample_tensor_or_seq", _CHECK)
compute_grad_samples_microbatch_and_opacus = absent(f"{_HERE}.compute_grad_samples_microbatch_and_opacus", _CHECK)
unpack_packedsequences = absent(f"{_HERE}.unpack_packedsequences", _CHECK)

__all__ = ["ModelWithLoss", "check_per_sample_gradients_are_correct", "check_torch_version_for_ew_sample",
           "clone_module", "compute_grad_samples_microbatch_and_opacus", "compute_microbatch_grad_sample",
           "compute_microbatch_grad_sample_tensor_or_seq", "compute_opacus_grad_sample", "get_grad_sample_modes",
           "is_batch_empty", "unpack_packedsequences"]
