"""Opacus's ``opacus.layers.param_rename``: Opacus's DP layers rename their parameters to the
torch layer's names through this mixin; dptrain's DP layers keep the torch layer's state_dict
keys themselves (dptrain.layers), so there is nothing to mix in."""

from dptrain.opacus._absent import absent

_INSTEAD = ("dptrain's DP layers (dptrain.opacus.layers: DPLSTM, DPGRU, DPRNN, "
            "DPMultiheadAttention), whose state_dict keys already are the torch layer's")
RenameParamsMixin = absent("opacus.layers.param_rename.RenameParamsMixin", _INSTEAD)
filter_out_old_keys = absent("opacus.layers.param_rename.filter_out_old_keys", _INSTEAD)

__all__ = ["RenameParamsMixin", "filter_out_old_keys"]
