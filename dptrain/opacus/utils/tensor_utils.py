"""Opacus's ``opacus.utils.tensor_utils``: helpers of Opacus's own per-sample gradient rules
(unfolding convolution inputs, per-sample norms), which dptrain's rules do not share; each name
raises when used, saying what dptrain offers instead."""

from dptrain.opacus._absent import absent

_HERE = "opacus.utils.tensor_utils"
_NORMS = ("dptrain.privacy.clipping (the optimizer clips; per-sample norms of a module's "
          "captured gradients: GradSampleModule.squared_norms())")
_UNFOLD = ("dptrain's convolution rule (dptrain.opacus.grad_sample.conv.compute_conv_grad_sample), "
           "or torch.nn.functional.unfold")
calc_sample_norms = absent(f"{_HERE}.calc_sample_norms", _NORMS)
calc_sample_norms_one_layer = absent(f"{_HERE}.calc_sample_norms_one_layer", _NORMS)
sum_over_all_but_batch_and_last_n = absent(
    f"{_HERE}.sum_over_all_but_batch_and_last_n", "tensor.sum(dim=...) over the dimensions to drop")
unfold2d = absent(f"{_HERE}.unfold2d", _UNFOLD)
unfold3d = absent(f"{_HERE}.unfold3d", _UNFOLD)
filter_dilated_rows = absent(f"{_HERE}.filter_dilated_rows", _UNFOLD)

__all__ = ["calc_sample_norms", "calc_sample_norms_one_layer", "filter_dilated_rows",
           "sum_over_all_but_batch_and_last_n", "unfold2d", "unfold3d"]
