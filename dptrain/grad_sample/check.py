"""Correctness check of per-sample gradients against micro-batch recomputation.

The ground truth for sample b is the gradient of ``loss_fn(model(x_b), y_b)`` where ``x_b`` is
sample b alone (batch dimension of size 1): no vectorisation, no hooks. The tests reuse
:func:`microbatch_grad_samples`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError

Inputs = Tensor | Sequence[Tensor]


def _as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    """``inputs`` as a tuple of tensors (one model argument each)."""
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _batch_size(inputs: tuple[Tensor, ...], targets: Tensor, batch_dim: int) -> int:
    """B shared by every input (at ``batch_dim``) and the targets (dim 0); ConfigError otherwise."""
    sizes = {f"inputs[{i}]": t.shape[batch_dim] for i, t in enumerate(inputs)}
    sizes["targets"] = targets.shape[0]
    if len(set(sizes.values())) != 1:
        raise ConfigError(
            f"check_per_sample_gradients: the batch dimension differs between arguments {sizes}; "
            f"every input (at dim {batch_dim}) and the targets (dim 0) must hold the same samples."
        )
    return targets.shape[0]


def microbatch_grad_samples(
    model: nn.Module,
    inputs: Inputs,
    targets: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch_first: bool = True,
) -> dict[str, Tensor]:
    """Per-sample gradients by running ``model`` on each sample alone.

    Args:
        model: the plain model, not wrapped (a live GradSampleModule would capture these runs).
        inputs: one tensor or a sequence of tensors, the model's positional arguments, each with
            the batch at dim 0 (``batch_first``) or dim 1.
        targets: ``[B, ...]``.
        loss_fn: ``loss_fn(output, target) -> scalar`` applied to one sample's output.

    Returns:
        ``{name: Tensor[B, *p.shape]}`` for every trainable parameter (zeros where unused).
    """
    dim = 0 if batch_first else 1
    args = _as_tuple(inputs)
    batch = _batch_size(args, targets, dim)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows: dict[str, list[Tensor]] = {n: [] for n, _ in params}
    for b in range(batch):
        sample = tuple(t.narrow(dim, b, 1) for t in args)
        loss = loss_fn(model(*sample), targets[b : b + 1])
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        for (name, p), g in zip(params, grads):
            rows[name].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(r) if r else torch.zeros(0, *p.shape) for (n, p), r in zip(params, rows.values())}


def _loss_reduction(loss_fn: Callable[[Tensor, Tensor], Tensor], loss_reduction: Optional[str]) -> str:
    """``loss_reduction`` if given, else ``loss_fn.reduction`` (torch losses), else "mean"."""
    if loss_reduction is not None:
        return loss_reduction
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ConfigError(
            f"check_per_sample_gradients: loss_fn.reduction is {reduction!r}; the batched loss must "
            f"be a scalar, so use a loss with reduction 'mean' or 'sum'."
        )
    return reduction


def wrapped_grad_samples(
    model: nn.Module,
    inputs: Inputs,
    targets: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch_first: bool = True,
    loss_reduction: Optional[str] = None,
) -> dict[str, Tensor]:
    """Per-sample gradients of one batched pass through a temporary GradSampleModule.

    ``p.grad`` is left untouched (the backward uses ``torch.autograd.grad``) and the hooks are
    removed afterwards. ``loss_reduction`` ("mean" or "sum") defaults to ``loss_fn.reduction``
    (torch's losses carry it), else "mean".
    """
    from dptrain.grad_sample.module import GradSampleModule

    reduction = _loss_reduction(loss_fn, loss_reduction)
    gsm = GradSampleModule(model, batch_first=batch_first, loss_reduction=reduction)
    gsm._audit.verify_sums = False  # report wrong per-sample gradients as numbers, not an error
    try:
        params = gsm.trainable_parameters()
        loss = loss_fn(gsm(*_as_tuple(inputs)), targets)
        torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        return {
            n: p.grad_sample if getattr(p, "grad_sample", None) is not None else torch.zeros(0)
            for n, p in params
        }
    finally:
        gsm.clear_per_sample()
        gsm.remove_hooks()


def check_per_sample_gradients(
    model: nn.Module,
    inputs: Inputs,
    targets: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch_first: bool = True,
    loss_reduction: Optional[str] = None,
) -> dict[str, float]:
    """Worst absolute error of the engine's per-sample gradients, per trainable parameter.

    Runs ``model`` once on the batch through :class:`~dptrain.GradSampleModule` and once per sample
    alone, and returns ``{param_name: max_b max |grad_sample_b - micro_batch_grad_b|}`` (``inf``
    where the engine produced no or a wrongly shaped per-sample gradient). Use float64 and a model
    without randomness (dropout in eval mode, or none) for a meaningful comparison.

    ``loss_reduction`` says how ``loss_fn`` reduces over the batch ("mean" or "sum"); by default it
    is read from ``loss_fn.reduction`` (torch's loss modules) and is "mean" for a plain function.
    """
    reduction = _loss_reduction(loss_fn, loss_reduction)
    truth = microbatch_grad_samples(model, inputs, targets, loss_fn, batch_first)
    engine = wrapped_grad_samples(model, inputs, targets, loss_fn, batch_first, reduction)
    errors = {}
    for name, expected in truth.items():
        got = engine[name]
        if got.shape != expected.shape:
            errors[name] = float("inf")
        else:
            errors[name] = (got - expected).abs().max().item() if got.numel() else 0.0
    return errors
