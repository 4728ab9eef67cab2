"""Opacus's ``opacus.schedulers.noise_scheduler``."""

from dptrain.opacus.schedulers import ExponentialNoise, LambdaNoise, StepNoise
from dptrain.opacus.schedulers import _NoiseScheduler

__all__ = ["ExponentialNoise", "LambdaNoise", "StepNoise"]
