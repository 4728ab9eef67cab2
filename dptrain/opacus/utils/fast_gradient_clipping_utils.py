"""Opacus's ``opacus.utils.fast_gradient_clipping_utils``: the ghost-clipping criterion that
make_private(grad_sample_mode="ghost") returns. Its loss is a plain torch tensor: dptrain's
ghost-clipping module clips in the one backward pass, so Opacus's tensor wrapper (whose
backward runs two passes) has no counterpart."""

from dptrain.opacus._absent import absent
from dptrain.opacus.privacy_engine import DPLossFastGradientClipping

DPTensorFastGradientClipping = absent(
    "opacus.utils.fast_gradient_clipping_utils.DPTensorFastGradientClipping",
    "the loss DPLossFastGradientClipping's call returns (a torch tensor): call loss.backward() "
    "and optimizer.step() as with grad_sample_mode='hooks'")

__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]
