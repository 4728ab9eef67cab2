"""Opacus's ``opacus.optimizers``: DPOptimizer and DistributedDPOptimizer with Opacus's signature
``DPOptimizer(optimizer, *, noise_multiplier, max_grad_norm, expected_batch_size,
loss_reduction="mean", generator=None, secure_mode=False)`` over dptrain's optimizers, and
Opacus's other optimizer classes (per-layer, adaptive, ghost clipping, distributed, FSDP).

make_private returns dptrain's own optimizer classes; ``isinstance`` against these classes answers
what Opacus's would for the optimizer its make_private returns (`_OpacusClass`): every dptrain
DPOptimizer is a DPOptimizer, one clipping per layer a DPPerLayerOptimizer, one over a
ghost-clipping module a DPOptimizerFastGradientClipping, and so on.

dptrain's optimizer clips through the module that computes the per-sample gradients: it is the
dptrain.opacus.grad_sample.GradSampleModule that owns the optimizer's parameters (or `module=`).
A DPOptimizer built by hand is accounted only by the hooks attached to it
(``attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate))``), as in Opacus. A subclass
that overrides Opacus's ``add_noise`` (or ``scale_grad``) has its step noised by them, as Opacus's
step does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from dptrain.errors import ConfigError

from dptrain.distributed.runtime import get_world_size
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.opacus.grad_sample import owner_of
from dptrain.opacus.optimizers.processed_flag import _check_processed_flag, _mark_as_processed
from dptrain.privacy.clipping import PerLayerClipper
from dptrain.privacy.distributed import DistributedDPOptimizer as CoreDistributedDPOptimizer
from dptrain.privacy.distributed import ShardedDPOptimizer
from dptrain.privacy.optimizer import DPOptimizer as CoreDPOptimizer


class _OpacusClass(type(CoreDPOptimizer)):  # type: ignore[misc]
    """Metaclass of the Opacus optimizer classes: isinstance(x, cls) holds for an instance of cls
    and for any dptrain optimizer that cls stands for (`cls._stands_for(x)`), as Opacus's
    isinstance holds for the optimizer its make_private returns."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or cls._stands_for(instance)


def _ghost(optimizer: Any) -> bool:
    """Whether `optimizer` clips through a ghost-clipping module."""
    return isinstance(getattr(optimizer, "module", None), GhostClippingModule)


def _clipping(optimizer: Any) -> str | None:
    """The name of `optimizer`'s clipping ("flat", "per_layer", "adaptive"...)."""
    return getattr(getattr(optimizer, "clipper", None), "name", None)


def _owning_module(optimizer: Optimizer, module: Any, name: str) -> Any:
    """`module`, or the GradSampleModule owning `optimizer`'s parameters (ValueError if none)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    module = module if module is not None else owner_of(params)
    if module is None:
        raise ValueError(f"{name}: no per-sample gradient module owns the optimizer's "
                         "parameters. Wrap the model first: model = "
                         "dptrain.opacus.grad_sample.GradSampleModule(model) (or pass "
                         "module=), or use PrivacyEngine.make_private.")
    return module


class DPOptimizer(CoreDPOptimizer, metaclass=_OpacusClass):
    """dptrain's DPOptimizer built from Opacus's keywords (`generator` seeds the noise); every
    dptrain DPOptimizer is an instance."""

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, CoreDPOptimizer)

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: int, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False,
                 module: Any = None, sample_rate: float = 1.0, **kwargs: Any) -> None:
        super().__init__(optimizer, noise_multiplier, max_grad_norm, expected_batch_size,
                         module=_owning_module(optimizer, module, "DPOptimizer"),
                         sample_rate=sample_rate, noise_generator=generator,
                         secure_mode=secure_mode)

    def add_noise(self) -> None:
        """Opacus's: p.grad = p.summed_grad + N(0, (sigma * C)^2), of p's shape (then
        `scale_grad`). Override it to add other noise, as Opacus's tutorial does."""
        std = self._gradient_noise_std()
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.grad = (p.summed_grad + self._noise(p, std)).view_as(p).to(p.dtype)
            _mark_as_processed(p.summed_grad)

    def scale_grad(self) -> None:
        """Opacus's: p.grad /= expected_batch_size (the mean over the expected batch)."""
        for p in self.params:
            p.grad /= self.expected_batch_size

    def _write_noisy_gradients(self) -> None:
        """dptrain's one-pass noising; for a subclass overriding add_noise or scale_grad, those
        two on the (combined) clipped sums, as Opacus's step calls them."""
        if (type(self).add_noise is DPOptimizer.add_noise
                and type(self).scale_grad is DPOptimizer.scale_grad):
            super()._write_noisy_gradients()
            return
        sums = {p: p.summed_grad if getattr(p, "summed_grad", None) is not None
                else torch.zeros_like(p) for p in self.params}
        combined = self._combine_clipped_sums(sums)
        for p in self.params:
            p.summed_grad = combined[p]
        self.add_noise()
        self.scale_grad()


class DistributedDPOptimizer(CoreDistributedDPOptimizer, metaclass=_OpacusClass):
    """dptrain's DistributedDPOptimizer built from Opacus's keywords, over the default group.

    As in Opacus, `expected_batch_size` is one rank's expected batch: the step writes
    p.grad = (S + Z) / (expected_batch_size * W), S the clipped sums of all W ranks and Z the
    noise drawn once, by rank 0 (what Opacus's mean of the ranks' (S_r + Z_r) / B_r gives).
    `optimizer.expected_batch_size` then holds dptrain's global expected batch, W times it.
    Building it is a collective (the ranks check they apply the same mechanism).
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: int, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False,
                 module: Any = None, sample_rate: float = 1.0, **kwargs: Any) -> None:
        super().__init__(optimizer, noise_multiplier, max_grad_norm,
                         expected_batch_size * get_world_size(),
                         module=_owning_module(optimizer, module, "DistributedDPOptimizer"),
                         sample_rate=sample_rate, noise_generator=generator,
                         secure_mode=secure_mode)

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        """Every dptrain optimizer that all-reduces the ranks' clipped sums (DDP)."""
        return (isinstance(optimizer, CoreDistributedDPOptimizer)
                and not isinstance(optimizer, ShardedDPOptimizer))


class DPPerLayerOptimizer(DPOptimizer):
    """Opacus's per-layer clipping: `max_grad_norm` a list of one bound per trainable parameter
    (in the optimizer's order), or one total split equally; the optimizer make_private(
    clipping="per_layer") returns is an instance."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float | list[float], expected_batch_size: int,
                 loss_reduction: str = "mean", generator: torch.Generator | None = None,
                 secure_mode: bool = False, module: Any = None, sample_rate: float = 1.0,
                 **kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        CoreDPOptimizer.__init__(
            self, optimizer, noise_multiplier, None, expected_batch_size,
            PerLayerClipper(max_grad_norm, params),
            module=_owning_module(optimizer, module, "DPPerLayerOptimizer"),
            sample_rate=sample_rate, noise_generator=generator, secure_mode=secure_mode)

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, CoreDPOptimizer) and _clipping(optimizer) == "per_layer"


class DPOptimizerFastGradientClipping(DPOptimizer):
    """Opacus's optimizer of ghost clipping: a DPOptimizer over a ghost-clipping module (pass
    `module=`, e.g. wrap_model(model, "ghost")); make_private(grad_sample_mode="ghost")'s is one."""

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, CoreDPOptimizer) and _ghost(optimizer)


class DistributedDPOptimizerFastGradientClipping(DistributedDPOptimizer):
    """Opacus's ghost clipping under DDP: a DistributedDPOptimizer over a ghost-clipping module."""

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return DistributedDPOptimizer._stands_for(optimizer) and _ghost(optimizer)


class DistributedPerLayerOptimizer(DistributedDPOptimizer):
    """Opacus's per-layer clipping under DDP (make_private(clipping="per_layer") of a DDP model
    returns one; build it that way)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_direct(type(self).__name__, 'make_private(..., clipping="per_layer") on a '
                       "DistributedDataParallel model")

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return DistributedDPOptimizer._stands_for(optimizer) and _clipping(optimizer) == "per_layer"


class SimpleDistributedPerLayerOptimizer(DistributedPerLayerOptimizer):
    """Opacus's other per-layer DDP optimizer: the same optimizer in dptrain."""


class AdaClipDPOptimizer(DPOptimizer):
    """Opacus's adaptive clipping (Andrew et al.): make_private(clipping="adaptive",
    target_unclipped_quantile=, clipbound_learning_rate=, count_noise_std=) returns one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_direct(type(self).__name__, 'PrivacyEngine.make_private(..., clipping="adaptive", '
                       "target_unclipped_quantile=..., clipbound_learning_rate=..., "
                       "count_noise_std=...)")

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, CoreDPOptimizer) and _clipping(optimizer) == "adaptive"


class FSDPOptimizerFastGradientClipping(DPOptimizer):
    """Opacus's ghost clipping of an FSDP2-sharded model: dptrain's ShardedDPOptimizer, which
    make_private(grad_sample_mode="ghost_fsdp") of a model sharded with
    utils.fsdp_utils.FSDP2Wrapper returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_direct(type(self).__name__, 'make_private(..., grad_sample_mode="ghost_fsdp") on '
                       "a model sharded with dptrain.opacus.utils.fsdp_utils.FSDP2Wrapper")

    @classmethod
    def _stands_for(cls, optimizer: Any) -> bool:
        return isinstance(optimizer, ShardedDPOptimizer)


def _refuse_direct(name: str, instead: str) -> None:
    """ConfigError: Opacus's `name` is not built by hand in dptrain.opacus; `instead` builds it."""
    raise ConfigError(
        f"dptrain.opacus.optimizers.{name} cannot be built directly: dptrain builds this "
        f"optimizer's clipping and module itself, from the plan. Use {instead}; the optimizer "
        f"it returns is an instance of {name} (isinstance holds).")


#: Opacus's spelling (sic) of DistributedDPOptimizerFastGradientClipping's other name
DistributedDPOptimizerFastGradientlipping = DistributedDPOptimizerFastGradientClipping


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str | None = None
                        ) -> type:
    """Opacus's: the optimizer class of `clipping` ("flat", "per_layer", "adaptive"),
    `distributed` and `grad_sample_mode` (the class isinstance matches make_private's with)."""
    ghost = grad_sample_mode in ("ghost", "ghost_fsdp")
    table = {("flat", False): DPOptimizerFastGradientClipping if ghost else DPOptimizer,
             ("flat", True): (FSDPOptimizerFastGradientClipping if grad_sample_mode == "ghost_fsdp"
                              else DistributedDPOptimizerFastGradientClipping if ghost
                              else DistributedDPOptimizer),
             ("per_layer", False): DPPerLayerOptimizer,
             ("per_layer", True): DistributedPerLayerOptimizer,
             ("adaptive", False): AdaClipDPOptimizer}
    if (clipping, distributed) not in table:
        raise ValueError(f"Unexpected optimizer parameters. Clipping: {clipping}, distributed: "
                         f"{distributed}, grad_sample_mode: {grad_sample_mode}")
    return table[(clipping, distributed)]


__all__ = ["AdaClipDPOptimizer", "DPOptimizer", "DPOptimizerFastGradientClipping",
           "DPPerLayerOptimizer", "DistributedDPOptimizer",
           "DistributedDPOptimizerFastGradientClipping", "DistributedPerLayerOptimizer",
           "FSDPOptimizerFastGradientClipping", "SimpleDistributedPerLayerOptimizer",
           "get_optimizer_class"]
