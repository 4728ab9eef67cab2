"""Opacus's ``opacus.utils.adaptive_clipping`` (see adaptive_clipping_utils)."""

from dptrain.opacus.utils.adaptive_clipping.adaptive_clipping_utils import (
    DPLossFastGradientAdaptiveClipping, DPTensorFastGradientAdaptiveClipping,
    PrivacyEngineAdaptiveClipping)

__all__ = ["DPLossFastGradientAdaptiveClipping", "DPTensorFastGradientAdaptiveClipping",
           "PrivacyEngineAdaptiveClipping"]
