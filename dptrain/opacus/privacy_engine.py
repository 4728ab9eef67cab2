"""Opacus's ``PrivacyEngine`` (``opacus.privacy_engine``) on dptrain's engine.

Opacus's keyword arguments are mapped onto dptrain's: ``poisson_sampling=False`` becomes
``sampling="given_shuffle"`` (the caller's loader kept, when its sampler puts each example in at
most one batch per pass) or else ``sampling="shuffle"`` (dptrain's own shuffle), both accounted
without amplification by the shuffle accountant, ``grad_sample_mode="functorch"``/``"ew"``
become ``"hooks"``, Opacus's adaptive-clipping names become dptrain's, and
``grad_sample_mode="ghost"`` returns Opacus's four values (model, optimizer, criterion, loader).
Each mapping that changes what runs warns (see dptrain.opacus._warn). Poisson sampling runs
at Opacus's q, 1 / len(data_loader) (dptrain's own engine takes batch_size / N).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import IO, Any, BinaryIO, Union

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.opacus._warn import changed
from dptrain.data import given_shuffle
from dptrain.data.sampling import dataset_size
from dptrain.opacus.accountants import create_accountant, opacus_accountant
from dptrain.opacus.accountants.utils import get_noise_multiplier
from dptrain.opacus.data_loader import opacus_rate_applies, opacus_sample_rate
from dptrain.opacus.validators import ModuleValidator
from dptrain.privacy import engine as core
from dptrain.privacy.plan import PrivacyPlan

_GRAD_SAMPLE_MODES = {"hooks": "hooks", "functorch": "hooks", "ew": "hooks", "ghost": "ghost",
                      "ghost_fsdp": "ghost"}
# the modes whose make_private returns Opacus's four values (with the ghost-clipping criterion);
# "ghost_fsdp" is ghost clipping of a model sharded with FSDP2 (utils.fsdp_utils.FSDP2Wrapper),
# which dptrain's ghost mode recognises by itself (dptrain/distributed/fsdp.py)
_GHOST_MODES = ("ghost", "ghost_fsdp")
# Opacus's adaptive-clipping keyword -> dptrain's (None: no dptrain counterpart)
_ADAPTIVE = {"target_unclipped_quantile": "target_unclipped_quantile",
             "clipbound_learning_rate": "clipbound_learning_rate",
             "unclipped_num_std": "count_noise_std", "max_clipbound": None, "min_clipbound": None}


def _load_trusted_or_weights(path: Union[str, os.PathLike, BinaryIO, IO[bytes]],
                             torch_load_kwargs: dict | None) -> Any:
    """``torch.load(path)`` with weights_only=True unless `torch_load_kwargs` opts out.

    ConfigError naming the opt-in when the file holds an object weights_only refuses: a file
    save_checkpoint wrote never does, so such a file came from elsewhere (Opacus's own
    checkpoints with custom objects, or a crafted pickle whose loading would run its code)."""
    kwargs = {"weights_only": True, **(torch_load_kwargs or {})}
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as error:
        if not kwargs["weights_only"]:
            raise
        raise ConfigError(
            f"PrivacyEngine.load_checkpoint refused {_shown(path)}: it holds objects that only "
            "full unpickling builds, and full unpickling runs whatever code the file names. "
            "A checkpoint written by save_checkpoint loads without it. If you trust whoever "
            "wrote this file, pass torch_load_kwargs={'weights_only': False}. torch's reason: "
            f"{str(error).splitlines()[0]}") from error


def _shown(path: Any) -> str:
    """A path for a message (a file object: its name, when it has one)."""
    return repr(str(getattr(path, "name", path)))


class DPLossFastGradientClipping:
    """Opacus's ghost-clipping criterion: ``criterion(output, target)`` gives the loss whose
    ``backward()`` does the ghost clipping (dptrain's GhostClippingModule does it in the one
    backward pass, so the loss is the plain criterion's, reduced as `loss_reduction` says)."""

    def __init__(self, module: nn.Module, optimizer: Any, criterion: nn.Module,
                 loss_reduction: str = "mean") -> None:
        self.module, self.optimizer, self.criterion = module, optimizer, criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.criterion(*args, **kwargs)


def _grad_sample_mode(mode: str) -> str:
    """dptrain's grad_sample_mode for Opacus's `mode` (ValueError for an unknown one)."""
    if mode not in _GRAD_SAMPLE_MODES:
        raise ValueError(f"Unexpected grad_sample_mode: {mode}; dptrain.opacus supports "
                         f"{sorted(_GRAD_SAMPLE_MODES)}.")
    if _GRAD_SAMPLE_MODES[mode] == "hooks" and mode != "hooks":
        changed(f"grad_sample_mode={mode!r} runs as 'hooks' (the same per-sample gradients); "
                "pass grad_sample_mode='hooks' to silence this.")
    return _GRAD_SAMPLE_MODES[mode]


def _check_same_parameters(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Opacus's check, with its wording: every parameter the optimizer updates is one of
    `module`'s (not a copy, as after ModuleValidator.fix once the optimizer was built)."""
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError(
            "Module parameters are different than optimizer Parameters: the optimizer updates "
            "tensors that are not the module's (was the model replaced, e.g. by "
            "ModuleValidator.fix(model), after the optimizer was built?). Build the optimizer "
            "from the module passed to make_private: optimizer = SGD(model.parameters(), ...).")


def _adaptive_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """dptrain's adaptive-clipping keywords for Opacus's (clip bounds are not bounded there)."""
    mapped = {}
    for name in list(kwargs):
        if name in _ADAPTIVE:
            value = kwargs.pop(name)
            if _ADAPTIVE[name] is None:
                changed(f"{name} is ignored: dptrain's adaptive clipping has no clip-bound limits.")
            else:
                mapped[_ADAPTIVE[name]] = value
    return mapped


def _non_poisson_sampling(data_loader: Any) -> str:
    """dptrain's sampling for Opacus's poisson_sampling=False over `data_loader`, with its
    warning: the loader kept ("given_shuffle") when dptrain.data.given_shuffle accepts it,
    dptrain's own shuffle of its dataset ("shuffle") otherwise."""
    unamplified = ("epsilon is accounted WITHOUT amplification by subsampling, each epoch one "
                   "Gaussian release of every example (larger than Opacus reports, which charges "
                   "such a loader as Poisson). Keep poisson_sampling=True for the amplified "
                   "epsilon.")
    reason = given_shuffle.problem(data_loader)
    if reason is None:
        changed(f"poisson_sampling=False: the DataLoader is kept (its batches, in its order), "
                f"and {unamplified}")
        return "given_shuffle"
    changed(f"poisson_sampling=False with a DataLoader that may put an example in two batches "
            f"of one pass ({reason}): dptrain trains fixed-size batches of its own shuffle of "
            f"the dataset each epoch instead, and {unamplified} A DataLoader with shuffle=True "
            "or False (and no sampler or batch_sampler) is kept as is.")
    return "shuffle"


class PrivacyEngine(core.PrivacyEngine):
    """Opacus's PrivacyEngine(accountant="prv", secure_mode=False) over dptrain's engine.

    The accountant is the Opacus-shaped one of dptrain.opacus.accountants. Without secure_mode
    the noise comes from OS entropy (not torch's global RNG): pass `noise_generator` to
    make_private for reproducible noise.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        super().__init__(accountant=create_accountant(accountant), secure_mode=secure_mode)

    def plan_of(self, data_loader: Any, **kwargs: Any) -> PrivacyPlan:
        """dptrain's plan of make_private's arguments, with Poisson sampling at Opacus's q:
        1 / len(data_loader) (Opacus's DPDataLoader.from_data_loader), so that the expected
        batch, the steps and the epsilon are Opacus's. It equals dptrain's batch_size / N when
        the batch size divides N; otherwise it is below it (N / ceil(N / B) expected examples a
        batch). A loader already private or with a DistributedSampler (whose batch_size dptrain
        reads as the global one), a rate schedule and user-level privacy keep dptrain's q."""
        plan = super().plan_of(data_loader, **kwargs)
        selection = plan.selection
        if (not selection.poisson or selection.schedule is not None
                or not plan.unit.samples_examples or not opacus_rate_applies(data_loader)):
            return plan
        return dataclasses.replace(plan, selection=dataclasses.replace(
            selection, sample_rate=opacus_sample_rate(data_loader)))

    @staticmethod
    def _loader_rate(data_loader: Any) -> tuple[int, float]:
        """(N, q) of a plain loader, by Opacus's rule q = 1 / len(data_loader) where dptrain's
        batch_size / N would exceed 1: a batch larger than the dataset is one batch a pass, q = 1
        (each step Poisson-samples every example with probability 1, and is charged so),
        where dptrain's own engine refuses it (`core.PrivacyEngine._loader_rate`)."""
        if opacus_rate_applies(data_loader) and len(data_loader) == 1:
            return dataset_size(data_loader), opacus_sample_rate(data_loader)
        return core.PrivacyEngine._loader_rate(data_loader)

    def _arguments(self, poisson_sampling: bool, grad_sample_mode: str,
                   kwargs: dict[str, Any], data_loader: Any) -> dict[str, Any]:
        """dptrain's make_private keywords for Opacus's."""
        for ignored in ("wrap_model", "rand_on_empty"):
            kwargs.pop(ignored, None)
        mapped = _adaptive_kwargs(kwargs)
        mapped["grad_sample_mode"] = _grad_sample_mode(grad_sample_mode)
        if not poisson_sampling:
            mapped["sampling"] = _non_poisson_sampling(data_loader)
        return {**kwargs, **mapped}

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,  # type: ignore[override]
                     criterion: nn.Module | None = None, data_loader: Any,
                     noise_multiplier: float | None = None,
                     max_grad_norm: float | list[float] = core.Default(1.0), batch_first: bool = True,
                     loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = core.Default("flat"),
                     noise_generator: torch.Generator | None = None,
                     grad_sample_mode: str = "hooks", **kwargs: Any) -> tuple:
        """Opacus's make_private: (module, optimizer, data_loader), and with
        grad_sample_mode="ghost" (module, optimizer, criterion, data_loader)."""
        _check_same_parameters(module, optimizer)
        arguments = self._arguments(poisson_sampling, grad_sample_mode, kwargs, data_loader)
        if noise_generator is None and not self.secure_mode and "plan" not in kwargs:
            changed("the noise is drawn from OS entropy, not torch's global RNG: torch.manual_seed "
                    "does not repeat it. Pass noise_generator=torch.Generator().manual_seed(s) "
                    "for reproducible noise.")
        model, dp_optimizer, loader = super().make_private(
            module=module, optimizer=optimizer, data_loader=data_loader,
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            batch_first=batch_first, loss_reduction=loss_reduction, clipping=clipping,
            noise_generator=noise_generator, **arguments)
        self.accountant = opacus_accountant(self.accountant)  # shuffled batches: Opacus-shaped
        # Opacus's GradSampleModule refuses a backward over a second Poisson batch without
        # zero_grad(); dptrain's optimizer refuses it there too when asked (else at the step)
        dp_optimizer.link.refuse_at_backward = True   # (an unlinked optimizer checks nothing)
        if grad_sample_mode not in _GHOST_MODES:
            return model, dp_optimizer, loader
        wrapped = DPLossFastGradientClipping(model, dp_optimizer, criterion or nn.CrossEntropyLoss(),
                                             loss_reduction)
        return model, dp_optimizer, wrapped, loader

    def make_private_with_epsilon(self, *, module: nn.Module,  # type: ignore[override]
                                  optimizer: torch.optim.Optimizer,
                                  criterion: nn.Module | None = None, data_loader: Any,
                                  target_epsilon: float, target_delta: float, epochs: int,
                                  max_grad_norm: float | list[float],
                                  poisson_sampling: bool = True, grad_sample_mode: str = "hooks",
                                  epsilon_tolerance: float = 0.01, **kwargs: Any) -> tuple:
        """Opacus's make_private_with_epsilon (the four values with grad_sample_mode="ghost").

        With Poisson sampling the noise multiplier is Opacus's: its bisection
        (accountants.utils.get_noise_multiplier) over int(epochs / q) steps at the loader's q,
        on this engine's accountant, then make_private. Otherwise (poisson_sampling=False is
        accounted as a shuffle, which Opacus's search knows nothing of) dptrain's calibration
        of the plan sets it."""
        if not poisson_sampling or "privacy_unit" in kwargs:
            arguments = self._arguments(poisson_sampling, grad_sample_mode, kwargs, data_loader)
            model, dp_optimizer, loader = super().make_private_with_epsilon(
                module=module, optimizer=optimizer, data_loader=data_loader,
                target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
                max_grad_norm=max_grad_norm, epsilon_tolerance=epsilon_tolerance, **arguments)
            if grad_sample_mode not in _GHOST_MODES:
                return model, dp_optimizer, loader
            return model, dp_optimizer, DPLossFastGradientClipping(
                model, dp_optimizer, criterion or nn.CrossEntropyLoss()), loader
        if len(self.accountant) > 0:
            changed("make_private_with_epsilon with privacy budget already spent: the noise "
                    "multiplier assumes zero starting point, so the overall epsilon will be "
                    "higher than target_epsilon.")
        sigma = get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=target_delta,
            sample_rate=self.plan_of(data_loader, noise_multiplier=1.0).selection.sample_rate,
            epochs=epochs, accountant=self.accountant.mechanism(),
            epsilon_tolerance=epsilon_tolerance)
        return self.make_private(module=module, optimizer=optimizer, criterion=criterion,
                                 data_loader=data_loader, noise_multiplier=sigma,
                                 max_grad_norm=max_grad_norm, grad_sample_mode=grad_sample_mode,
                                 poisson_sampling=True, **kwargs)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """Opacus's: the fixed copy of `module` (ModuleValidator.fix), validated strictly."""
        return ModuleValidator.fix_and_validate(module)

    @classmethod
    def is_compatible(cls, *, module: nn.Module, optimizer: Any = None,
                      data_loader: Any = None) -> bool:
        """True when ModuleValidator finds no problem in `module`."""
        return ModuleValidator.is_valid(module)

    @classmethod
    def validate(cls, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> None:
        """Raise UnsupportedModuleError for any problem ModuleValidator finds in `module`."""
        ModuleValidator.validate(module, strict=True)

    def save_checkpoint(self, *, path: Union[str, os.PathLike, BinaryIO, IO[bytes]],
                        module: nn.Module, optimizer: Any = None, noise_scheduler: Any = None,
                        grad_clip_scheduler: Any = None, checkpoint_dict: dict | None = None,
                        module_state_dict_kwargs: dict | None = None,
                        torch_save_kwargs: dict | None = None) -> None:
        """Opacus's checkpoint: module, accountant, optimizer and scheduler states at `path`."""
        checkpoint = dict(checkpoint_dict or {})
        checkpoint["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
        checkpoint["privacy_accountant_state_dict"] = self.accountant.state_dict()
        for key, obj in (("optimizer_state_dict", optimizer),
                         ("noise_scheduler_state_dict", noise_scheduler),
                         ("grad_clip_scheduler_state_dict", grad_clip_scheduler)):
            if obj is not None:
                checkpoint[key] = obj.state_dict()
        torch.save(checkpoint, path, **(torch_save_kwargs or {}))

    def load_checkpoint(self, *, path: Union[str, os.PathLike, BinaryIO, IO[bytes]],
                        module: nn.Module, optimizer: Any = None, noise_scheduler: Any = None,
                        grad_clip_scheduler: Any = None,
                        module_load_dict_kwargs: dict | None = None,
                        torch_load_kwargs: dict | None = None) -> dict:
        """Restore what save_checkpoint wrote; returns the rest of the checkpoint dict.

        The file is read with ``torch.load(weights_only=True)`` (Opacus reads it with
        ``weights_only=False``): loading runs none of the file's code, and everything
        save_checkpoint writes (state dicts of tensors, numbers, strings, lists and tuples) loads
        that way. ``torch_load_kwargs={"weights_only": False}`` unpickles in full, which runs
        whatever code the file names: pass it only for a file you trust that holds other
        objects (see `_load_trusted_or_weights`)."""
        checkpoint = _load_trusted_or_weights(path, torch_load_kwargs)
        module.load_state_dict(checkpoint.pop("module_state_dict"),
                               **(module_load_dict_kwargs or {}))
        self.load_accountant_state(checkpoint.pop("privacy_accountant_state_dict"))
        for key, obj in (("optimizer_state_dict", optimizer),
                         ("noise_scheduler_state_dict", noise_scheduler),
                         ("grad_clip_scheduler_state_dict", grad_clip_scheduler)):
            state = checkpoint.pop(key, None)
            if obj is not None and state:
                obj.load_state_dict(state)
        return checkpoint
