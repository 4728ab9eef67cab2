"""Backward audit: catch parameters whose per-sample gradients would silently be wrong.

A per-sample gradient is only captured where a parameter is used inside the forward of the module
that owns it. A parameter used elsewhere (``self.fc.weight @ x`` in a parent's forward) gets a
``.grad`` that its per-sample gradients do not explain. Two checks, per backward:

- every backward that captured something: a trainable parameter that received a gradient while
  its module produced no per-sample contribution in that backward is an error (cheap: a set
  difference). Backward passes through a model in eval mode capture nothing and are not audited;
- the first backward with per-sample gradients: for every parameter, the per-sample gradients
  summed over the batch (times 1/B for a mean-reduced loss) must equal the gradient autograd
  computed in that backward, which also catches a parameter used both inside and outside its
  module. Costs one sum over the batch per parameter, once. A backward whose gradients are not
  all finite (an example with a NaN or inf input, which clipping leaves out) cannot be checked
  this way: the check moves to the next backward, so that such an example never makes a step fail
  (the failure would reveal that it was sampled).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError

_OUTSIDE_USE = (
    "This happens when a parameter is used outside the forward of the module that owns it (e.g. "
    "`self.fc.weight @ x` in a parent's forward: call `self.fc(x)` instead, or move the parameter "
    "into a module of its own whose forward uses it), or when that module ran in eval mode."
)


def _finite(t: Tensor | None) -> bool:
    """Whether every entry of `t` is finite (None: nothing to compare, finite)."""
    return t is None or bool(torch.isfinite(t).all())


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the sum check: 10 * sqrt(machine epsilon) of ``dtype``."""
    return 10 * torch.finfo(dtype).eps ** 0.5


class BackwardAudit:
    """Book-keeping of one backward pass; :meth:`finish` raises on inconsistencies.

    Args:
        names: ``{id(param): name}`` for the messages.
    """

    def __init__(self, names: dict[int, str]) -> None:
        self._names = names
        self.verify_sums = True
        self._received: dict[int, Tensor | None] = {}
        self._covered: set[int] = set()
        self._sums: dict[int, Tensor] = {}
        self._magnitudes: dict[int, float] = {}

    def received(self, param: nn.Parameter, grad: Tensor) -> None:
        """Autograd produced ``grad`` (shape ``param.shape``; sparse for ``Embedding(sparse=True)``)
        for ``param`` in this backward."""
        if not self.verify_sums:
            self._received[id(param)] = None
            return
        self._received[id(param)] = grad.detach().to_dense() if grad.is_sparse else grad.detach()

    def covered(self, params: list[nn.Parameter]) -> None:
        """The module owning ``params`` produced per-sample contributions in this backward."""
        self._covered.update(id(p) for p in params)

    def contribution(self, param: nn.Parameter, grad_sample: Tensor, loss_scale: float) -> None:
        """Per-sample gradients ``[B, *param.shape]`` of one use; ``loss_scale`` is 1/B or 1."""
        if not self.verify_sums:
            return
        total = grad_sample.sum(dim=0) * loss_scale
        key = id(param)
        self._sums[key] = self._sums[key] + total if key in self._sums else total
        # sum_b ||g_b|| <= sqrt(B) ||G||_F bounds the size of the terms, hence the rounding error
        size = (grad_sample.shape[0] ** 0.5) * torch.linalg.vector_norm(grad_sample).item() * loss_scale
        self._magnitudes[key] = self._magnitudes.get(key, 0.0) + size

    def reset(self) -> None:
        """Forget this backward's book-keeping (also after a backward that failed)."""
        self._received, self._covered, self._sums, self._magnitudes = {}, set(), {}, {}

    def finish(self) -> None:
        """End of backward: reset, then raise UnsupportedModuleError on a problem."""
        received, covered, sums, sizes = self._received, self._covered, self._sums, self._magnitudes
        self.reset()
        if not covered:  # nothing was captured (eval mode, no_grad forward): nothing to audit
            return
        missing = [self._names.get(k, "?") for k in received if k not in covered]
        if missing:
            raise UnsupportedModuleError(
                f"Parameters {missing} received a gradient but no per-sample gradient in this "
                f"backward pass. {_OUTSIDE_USE}"
            )
        if not (self.verify_sums and sums):
            return
        if not all(_finite(t) and _finite(received.get(k)) for k, t in sums.items()):
            return  # NaN - NaN proves nothing: check the next backward instead
        self.verify_sums = False
        floor = max((torch.linalg.vector_norm(g).item() for g in received.values() if g is not None), default=0.0)
        wrong = [
            self._names.get(k, "?")
            for k, total in sums.items()
            if not self._matches(received.get(k), total, sizes[k] + floor)
        ]
        if wrong:
            raise UnsupportedModuleError(
                f"The per-sample gradients of parameters {wrong} do not add up to their gradient "
                f"(checked on the first backward pass), so they would be wrong. {_OUTSIDE_USE} "
                f"A custom sampler registered for the owning layer type can also be wrong: measure "
                f"it with dptrain.check_per_sample_gradients(model, inputs, targets, loss_fn)."
            )

    @staticmethod
    def _matches(grad: Tensor | None, total: Tensor, scale: float) -> bool:
        """Whether the summed per-sample gradients equal autograd's gradient.

        ``scale`` bounds the summed norms of the added terms plus the largest gradient norm of the
        model in this backward; the tolerance is relative to it and to this gradient's norm (a
        gradient that cancels to rounding noise, like an attention key bias, is then accepted).
        """
        if grad is None:  # not among autograd.grad's inputs: nothing to compare
            return True
        total = total.to(grad.dtype)
        scale += torch.linalg.vector_norm(grad).item() + torch.finfo(grad.dtype).tiny
        return bool(torch.linalg.vector_norm(grad - total).item() <= _tolerance(grad.dtype) * scale)
