"""Opacus's ``opacus.utils.adaptive_clipping.adaptive_clipping_utils``: adaptive clipping with
ghost clipping through Opacus's own engine and loss wrappers. dptrain's adaptive clipping (Andrew
et al.: a noisy unclipped count moves the bound each step) is a clipping of the one
PrivacyEngine, in every grad_sample_mode, ghost included."""

from dptrain.opacus._absent import absent

_HERE = "opacus.utils.adaptive_clipping.adaptive_clipping_utils"
_INSTEAD = ("dptrain.opacus.PrivacyEngine().make_private(..., clipping='adaptive', "
            "target_unclipped_quantile=..., clipbound_learning_rate=..., count_noise_std=..., "
            "grad_sample_mode='ghost'), whose criterion's loss.backward() clips adaptively")
PrivacyEngineAdaptiveClipping = absent(f"{_HERE}.PrivacyEngineAdaptiveClipping", _INSTEAD)
DPLossFastGradientAdaptiveClipping = absent(f"{_HERE}.DPLossFastGradientAdaptiveClipping",
                                            _INSTEAD)
DPTensorFastGradientAdaptiveClipping = absent(f"{_HERE}.DPTensorFastGradientAdaptiveClipping",
                                              _INSTEAD)

__all__ = ["DPLossFastGradientAdaptiveClipping", "DPTensorFastGradientAdaptiveClipping",
           "PrivacyEngineAdaptiveClipping"]
