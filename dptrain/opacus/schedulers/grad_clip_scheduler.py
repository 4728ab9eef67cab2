"""Opacus's ``opacus.schedulers.grad_clip_scheduler``."""

from dptrain.opacus.schedulers import ExponentialGradClip, LambdaGradClip, StepGradClip
from dptrain.opacus.schedulers import _GradClipScheduler

__all__ = ["ExponentialGradClip", "LambdaGradClip", "StepGradClip"]
