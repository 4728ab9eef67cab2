"""Opacus's ``opacus.grad_sample``: GradSampleModule (and the ghost-clipping module) of dptrain,
``register_grad_sampler``; ``GradSampleModule(m, force_functorch=..)`` and the modes
"functorch"/"ew" run dptrain's hooks (the same per-sample gradients)."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule as CoreGradSampleModule
from dptrain.grad_sample.registry import register_grad_sampler

GradSampleModuleFastGradientClipping = GhostClippingModule


class _AnyGradSampleModule(type(CoreGradSampleModule)):  # type: ignore[misc]
    """isinstance(m, dptrain.opacus.GradSampleModule) holds for every dptrain GradSampleModule,
    as Opacus's holds for the module its make_private returns."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, CoreGradSampleModule)


class GradSampleModule(CoreGradSampleModule, metaclass=_AnyGradSampleModule):
    """dptrain's GradSampleModule with Opacus's keywords (strict, force_functorch: accepted;
    dptrain always validates the model and picks its own per-layer rules). A hand-built
    DPOptimizer over its parameters finds it (`owner_of`), as Opacus's does."""

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 strict: bool = True, force_functorch: bool = False, **kwargs: Any) -> None:
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        for p in self.parameters():
            _OWNERS[id(p)] = self

    def __repr__(self) -> str:
        return f"GradSampleModule({self._module!r})"  # Opacus's


# id(parameter) -> the GradSampleModule made here that computes its per-sample gradients (how an
# Opacus-style DPOptimizer, built from a plain optimizer, finds its module); an entry lives as
# long as its module, which keeps the parameter (so its id) alive
_OWNERS: "weakref.WeakValueDictionary[int, GradSampleModule]" = weakref.WeakValueDictionary()


def owner_of(params: list[nn.Parameter]) -> CoreGradSampleModule | None:
    """The GradSampleModule (made by dptrain.opacus) owning the first of `params`, or None."""
    return next((_OWNERS[id(p)] for p in params if id(p) in _OWNERS), None)


def wrap_model(model: nn.Module, grad_sample_mode: str, *args: Any, **kwargs: Any) -> nn.Module:
    """Opacus's wrap_model: the GradSampleModule ("hooks", "functorch", "ew") or the
    ghost-clipping module ("ghost") of `model`."""
    if grad_sample_mode == "ghost":
        return GhostClippingModule(model, batch_first=kwargs.get("batch_first", True),
                                   loss_reduction=kwargs.get("loss_reduction", "mean"))
    if grad_sample_mode not in ("hooks", "functorch", "ew"):
        raise ValueError(f"Unexpected grad_sample_mode: {grad_sample_mode}")
    return GradSampleModule(model, **kwargs)


def get_gsm_class(grad_sample_mode: str) -> type:
    """The module class of `grad_sample_mode` ("hooks", "functorch", "ew": GradSampleModule;
    "ghost", "ghost_fsdp": the ghost-clipping module, which also serves an FSDP2-sharded model)."""
    if grad_sample_mode in ("ghost", "ghost_fsdp"):
        return GradSampleModuleFastGradientClipping
    if grad_sample_mode in ("hooks", "functorch", "ew"):
        return GradSampleModule
    raise ValueError(f"Unexpected grad_sample_mode: {grad_sample_mode}")


def prepare_module(model: nn.Module, grad_sample_mode: str, wrap_model: bool = True,
                   *args: Any, **kwargs: Any) -> nn.Module:
    """Opacus's prepare_module: `model` wrapped for `grad_sample_mode` (wrap_model), or as is
    with wrap_model=False."""
    return _wrap_model(model, grad_sample_mode, *args, **kwargs) if wrap_model else model


_wrap_model = wrap_model  # prepare_module's keyword wrap_model hides the function there


# Opacus's other names in this package (each module holds its own; imported last: they import
# the classes above)
from dptrain.grad_sample.registry import register_norm_sampler  # noqa: E402
from dptrain.opacus.grad_sample.grad_sample_module import (  # noqa: E402
    GradSampleHooks, create_or_accumulate_grad_sample)
from dptrain.opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (  # noqa: E402
    GradSampleHooksFastGradientClipping)
from dptrain.opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (  # noqa: E402
    GradSampleHooksFastGradientClippingFSDP, GradSampleModuleFastGradientClippingFSDP)
from dptrain.opacus.grad_sample.grad_sample_module_fast_gradient_clipping_tp import (  # noqa: E402
    GradSampleHooksFastGradientClippingTP, GradSampleModuleFastGradientClippingTP)
from dptrain.opacus.grad_sample.gsm_base import (  # noqa: E402
    AbstractGradSampleHooks, AbstractGradSampleModule)
from dptrain.opacus.grad_sample.gsm_exp_weights import GradSampleModuleExpandedWeights  # noqa: E402
from dptrain.opacus.grad_sample.gsm_no_op import GradSampleHooksNoOp, GradSampleModuleNoOp  # noqa: E402

__all__ = ["AbstractGradSampleHooks", "AbstractGradSampleModule", "GradSampleHooks",
           "GradSampleHooksFastGradientClipping", "GradSampleHooksFastGradientClippingFSDP",
           "GradSampleHooksFastGradientClippingTP", "GradSampleHooksNoOp", "GradSampleModule",
           "GradSampleModuleExpandedWeights", "GradSampleModuleFastGradientClipping",
           "GradSampleModuleFastGradientClippingFSDP", "GradSampleModuleFastGradientClippingTP",
           "GradSampleModuleNoOp", "create_or_accumulate_grad_sample", "get_gsm_class",
           "prepare_module", "register_grad_sampler", "register_norm_sampler", "wrap_model"]
