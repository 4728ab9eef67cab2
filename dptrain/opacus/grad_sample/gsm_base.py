"""Opacus's ``opacus.grad_sample.gsm_base``: the base of the per-sample gradient modules is
dptrain's GradSampleModule (the ghost-clipping module is a subclass), so
isinstance(m, AbstractGradSampleModule) holds for every module make_private returns."""

from dptrain.grad_sample.module import GradSampleModule as AbstractGradSampleModule
from dptrain.opacus._absent import absent
from dptrain.opacus.grad_sample._hooks import HOOKS

AbstractGradSampleHooks = absent("opacus.grad_sample.gsm_base.AbstractGradSampleHooks", HOOKS)

__all__ = ["AbstractGradSampleHooks", "AbstractGradSampleModule"]
