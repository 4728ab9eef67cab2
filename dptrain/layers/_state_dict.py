"""State-dict compatibility between a DP layer and the torch layer it replaces.

A DP layer keeps its parameters in ``nn.Linear`` submodules, but its ``state_dict`` must use the
torch layer's keys (``weight_ih_l0``, ``in_proj_weight``, ...) so checkpoints move freely between
the two. :class:`TorchStateDictMixin` installs hooks that translate between the internal keys and
the torch keys: on ``state_dict``, on ``load_state_dict``, and in the missing/unexpected keys a
failed strict load reports.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

StateDict = dict[str, torch.Tensor]


class TorchStateDictMixin(nn.Module):
    """Make ``state_dict`` / ``load_state_dict`` speak the torch layer's key names.

    Subclasses call :meth:`_install_torch_naming` at the end of ``__init__`` and implement
    :meth:`_torch_key_of` (one internal key -> its torch key), :meth:`_torch_to_internal` and,
    unless the keys map one to one, :meth:`_internal_to_torch`. The translations receive the keys
    of this module only, without the prefix, and pass keys they do not know through unchanged (so
    that a strict load still reports them).
    """

    def _install_torch_naming(self) -> None:
        self.register_state_dict_post_hook(_export_torch_keys)
        self.register_load_state_dict_pre_hook(_import_torch_keys)
        self.register_load_state_dict_post_hook(_report_torch_keys)

    def _torch_key_of(self, key: str) -> str:
        """The torch key holding internal ``key`` (e.g. ``ih_l0.weight`` -> ``weight_ih_l0``)."""
        raise NotImplementedError

    def _torch_key_order(self) -> list[str]:
        """Torch's order of this layer's keys (the order of its ``state_dict``)."""
        return []

    def _internal_to_torch(self, local: StateDict) -> StateDict:
        """Internal keys -> torch keys, key by key, in torch's order."""
        renamed = {self._torch_key_of(key): value for key, value in local.items()}
        ordered = {key: renamed.pop(key) for key in self._torch_key_order() if key in renamed}
        return {**ordered, **renamed}

    def _torch_to_internal(self, local: StateDict) -> StateDict:
        """Torch keys -> internal keys; unknown keys pass through."""
        raise NotImplementedError


def rename_key(key: str, pattern: re.Pattern[str], template: str) -> str:
    """Rewrite ``key`` with ``template`` (filled with the match groups) if it matches."""
    match = pattern.match(key)
    return template.format(*match.groups()) if match else key


def _split_local(state_dict: dict[str, Any], prefix: str) -> StateDict:
    """Remove and return the entries under ``prefix`` (keys stripped of it)."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    return {key[len(prefix) :]: state_dict.pop(key) for key in keys}


def _export_torch_keys(
    module: TorchStateDictMixin, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    local = _split_local(state_dict, prefix)
    for key, value in module._internal_to_torch(local).items():
        state_dict[prefix + key] = value


def _import_torch_keys(
    module: TorchStateDictMixin,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    module.__dict__["_loading_prefix"] = prefix  # read back by _report_torch_keys
    local = _split_local(state_dict, prefix)
    for key, value in module._torch_to_internal(local).items():
        state_dict[prefix + key] = value


def _report_torch_keys(module: TorchStateDictMixin, incompatible: _IncompatibleKeys) -> None:
    """Name this module's missing/unexpected keys as torch does (in place, as torch requires)."""
    prefix = module.__dict__.pop("_loading_prefix", None)
    if prefix is None:
        return
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        renamed: list[str] = []
        for key in keys:
            if key.startswith(prefix):
                key = prefix + module._torch_key_of(key[len(prefix) :])
            if key not in renamed:
                renamed.append(key)
        keys[:] = renamed
