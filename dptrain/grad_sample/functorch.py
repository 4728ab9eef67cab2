"""Generic per-sample gradients with ``torch.func`` for layers that have no registered sampler.

For a layer that directly owns trainable parameters ``theta`` and was called as
``y = layer(*args, **kwargs)``, sample b's gradient is ``grad_theta <layer(x_b), g_b>`` where
``x_b`` are sample b's inputs (batch dimension of size 1) and ``g_b`` the gradient of its own loss
w.r.t. its output. We ``vmap`` that over the batch: exact for any layer whose per-sample outputs
depend only on that sample's inputs (what the validator guarantees). Children's parameters are held
constant (their own hooks give theirs).

The re-run covers the layer's whole forward, children included: a model owning a parameter at its
root re-runs the whole model once more per batch, and a forward that draws random numbers
(dropout) cannot be re-run identically, so it is refused with an explanation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dptrain.errors import UnsupportedModuleError


def _batched_in_dims(values: Any, batch_dim: int, batch: int) -> Any:
    """vmap ``in_dims`` for a pytree: ``batch_dim`` for tensors with B there, else None."""
    leaves, spec = tree_flatten(values)
    dims = [
        batch_dim if isinstance(v, Tensor) and v.dim() > batch_dim and v.shape[batch_dim] == batch else None
        for v in leaves
    ]
    return tree_unflatten(dims, spec)


def _restore_batch_dim(values: Any, in_dims: Any, batch_dim: int) -> Any:
    """Re-insert a batch dimension of size 1 where vmap removed one."""
    leaves, spec = tree_flatten(values)
    dims = tree_leaves(in_dims, is_leaf=lambda d: d is None)
    restored = [v.unsqueeze(batch_dim) if d is not None else v for v, d in zip(leaves, dims)]
    return tree_unflatten(restored, spec)


def functorch_grad_samples(
    layer: nn.Module,
    args: tuple,
    kwargs: dict,
    backprops: tuple[Tensor, ...],
    out_leaves: list[int],
    batch_dim: int,
    name: str = "",
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of ``layer``'s own trainable parameters.

    Args:
        layer: the module (its forward must be a per-sample function of its inputs).
        args, kwargs: the inputs of the forward call, in the model's layout (batch at
            ``batch_dim``); tensors without the batch size there are shared by all samples.
        backprops: gradients of each sample's own loss w.r.t. the layer's differentiable outputs,
            batch first, each ``[B, *out_shape_without_batch]``.
        out_leaves: position of each of those outputs in ``tree_leaves(output)``.
        batch_dim: 0 for batch-first models, 1 for sequence-first.
        name: the layer's path in the model, for error messages.

    Returns:
        ``{param: Tensor[B, *param.shape]}``.
    """
    params = {n: p for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    if not params:
        return {}
    batch = backprops[0].shape[0]
    inputs = (args, kwargs)
    in_dims = _batched_in_dims(inputs, batch_dim, batch)
    detached = {n: p.detach() for n, p in params.items()}

    def sample_loss(theta: dict[str, Tensor], sample_inputs: tuple, sample_grads: tuple) -> Tensor:
        a, k = _restore_batch_dim(sample_inputs, in_dims, batch_dim)
        outputs = functional_call(layer, theta, a, k, strict=False)
        leaves = tree_leaves(outputs)
        outs = [leaves[i] for i in out_leaves]
        return sum((o.squeeze(batch_dim) * g).sum() for o, g in zip(outs, sample_grads))

    per_sample = vmap(grad(sample_loss), in_dims=(None, in_dims, 0))
    try:
        with torch.enable_grad():
            grads = per_sample(detached, inputs, backprops)
    except RuntimeError as err:
        if "random" not in str(err):
            raise
        raise _random_forward_error(layer, name) from err
    return {params[n]: g for n, g in grads.items()}


def _random_forward_error(layer: nn.Module, name: str) -> UnsupportedModuleError:
    """The error for a fallback layer whose forward draws random numbers (e.g. dropout)."""
    kind = type(layer).__name__
    where = f"Submodule '{name}' ({kind})" if name else f"The model itself ({kind})"
    return UnsupportedModuleError(
        f"{where} owns parameters directly and has no grad sampler, so its "
        f"per-sample gradients are computed by re-running its forward per sample with torch.func; "
        f"its forward draws random numbers (e.g. dropout, in it or in a child), which that re-run "
        f"cannot reproduce. Move those parameters into a small submodule of their own whose "
        f"forward is deterministic (e.g. a module that adds the position embedding), or register "
        f"a grad sampler for {kind} with @dptrain.register_grad_sampler({kind})."
    )
