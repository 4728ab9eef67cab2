"""Book-keeping for any layer: its clipped sum as one vector-Jacobian product of the layer.

For a layer whose outputs are per-sample functions of its inputs (what the validator guarantees),
sample ``i``'s gradient of the layer's own parameters ``theta`` is ``J_i^T g_i`` (``J_i`` the
Jacobian of its output w.r.t. ``theta``, ``g_i`` the gradient of sample ``i``'s own loss w.r.t. that
output). Hence

    sum_i w_i grad_i(theta) = J^T (w * G),

one backward of the layer, re-run at its stored inputs, with each sample's output gradient scaled
by its weight. The ghost module uses this as the clipped sum of a layer that has a norm sampler
(for instance one a user registered with ``dptrain.register_norm_sampler``) but no closed-form
clipped-sum rule (``ghost_registry.register_clipped_sum``): no per-sample gradient is formed, at the
cost of one extra forward and backward of that layer. The layer's forward must be deterministic:
a re-run that draws random numbers (dropout inside the layer) would not reproduce the recorded
call, so the clipped sum would not be the one whose norms were clipped; it is refused.

The re-run is in float32 at least, outside autocast (16-bit parameters, buffers and recorded inputs
converted: bf16 weights, or inputs recorded under bf16 autocast): a 16-bit backward would round the clipped sum,
and with it each sample's contribution, to 16 bits (up to 2^-8 of it above the clipping bound in
bf16).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost_math import norm_dtype, promoted


def _params_by_weights(
    named: list[tuple[str, nn.Parameter]], weights: dict[nn.Parameter, Tensor]
) -> list[tuple[Tensor, list[tuple[str, nn.Parameter]]]]:
    """Group the parameters that share the same weight vector (flat clipping: one group)."""
    groups: list[tuple[Tensor, list[tuple[str, nn.Parameter]]]] = []
    for name, p in named:
        w = weights[p]
        for shared, members in groups:
            if shared is w or torch.equal(shared, w):
                members.append((name, p))
                break
        else:
            groups.append((w, [(name, p)]))
    return groups


def vjp_clipped_sums(
    layer: nn.Module,
    args: tuple,
    kwargs: dict,
    out_leaf: int,
    backprops: Tensor,
    weights: dict[nn.Parameter, Tensor],
    batch_dim: int,
) -> dict[nn.Parameter, Tensor]:
    """``{p: sum_i weights[p][i] * grad_i(p)}`` for the layer's own parameters in ``weights``.

    Args:
        layer: the module; called again as ``layer(*args, **kwargs)``. The caller pauses any
            capture hooks on it.
        args, kwargs: the recorded inputs, in the model's layout (batch at ``batch_dim``).
        out_leaf: position of the differentiable output in ``tree_leaves(layer(...))``.
        backprops: gradient of each sample's own loss w.r.t. that output, batch FIRST,
            ``[B, *out_shape_without_batch]``.
        weights: ``{param: Tensor[B]}`` (clipping factors); parameters sharing one weight vector
            share one backward.
        batch_dim: 0 for batch-first models, 1 for sequence-first.

    Returns:
        ``{param: Tensor[*param.shape]}`` in the dtype of the re-run's output (float32 or float64).
    """
    own = [(n, p) for n, p in layer.named_parameters(recurse=False) if p in weights]
    before = _rng_states(backprops.device)
    fixed = {n: promoted(t) for n, t in [*layer.named_parameters(), *layer.named_buffers()]}
    args, kwargs = tree_map(promoted, (args, kwargs))
    g = backprops.to(norm_dtype(backprops))
    sums: dict[nn.Parameter, Tensor] = {}
    for w, members in _params_by_weights(own, weights):
        theta = {n: fixed[n].detach().requires_grad_(True) for n, _ in members}
        with torch.enable_grad(), torch.autocast(backprops.device.type, enabled=False):
            output = tree_leaves(functional_call(layer, {**fixed, **theta}, args, kwargs, strict=False))[out_leaf]
            scaled = g * w.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
            cotangent = scaled.movedim(0, batch_dim).to(output.dtype)
            grads = torch.autograd.grad(output, list(theta.values()), cotangent, allow_unused=True)
        for (_, p), grad in zip(members, grads):
            sums[p] = torch.zeros_like(p, dtype=output.dtype) if grad is None else grad
    if not _same_states(before, _rng_states(backprops.device)):
        raise _random_forward_error(layer)
    return sums


def _rng_states(device: torch.device) -> list[Tensor]:
    """The CPU generator's state, and ``device``'s when it is a CUDA device."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _same_states(before: list[Tensor], after: list[Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after))


def _random_forward_error(layer: nn.Module) -> UnsupportedModuleError:
    """The error for a re-run layer whose forward draws random numbers (e.g. dropout)."""
    kind = type(layer).__name__
    return UnsupportedModuleError(
        f"Ghost clipping re-runs {kind}'s forward to form its clipped gradient sum (it has a norm "
        f"sampler but no clipped-sum rule), and that forward draws random numbers (e.g. dropout), "
        f"so the re-run would not match the clipped norms. Move the random operation out of "
        f"{kind}'s forward and its children (e.g. into the parent's forward), register a "
        f"clipped-sum rule with "
        f"dptrain.grad_sample.ghost_registry.register_clipped_sum({kind}), or train with "
        f"grad_sample_mode='hooks'."
    )
