"""ModuleValidator: find (and fix) modules that cannot be trained with DP-SGD as they are.

DP-SGD needs every sample's gradient to depend on that sample alone, and nothing computed from
private data may leave the model outside the noisy gradients. Rejected:

- every BatchNorm (trainable or frozen): in training mode it normalises each sample with
  statistics of the whole batch (mixing samples), and it updates running statistics from private
  data that are saved with the model without any noise;
- InstanceNorm with ``track_running_stats=True``: its running statistics leak the same way;
- trainable ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (and their cells) / ``nn.MultiheadAttention``:
  fused kernels with no per-sample view; the DP layers of :mod:`dptrain.layers` compute the same
  function.

``ModuleValidator.fix`` replaces each by a module that validates, carrying the weights over.

A module that updates one of its buffers from the data during a training forward (running
statistics of a custom layer) leaks the same way, but no static check can see it: the per-sample
gradient wrappers run every training forward under :func:`refuse_buffer_updates`, which raises at
the first forward that changes a buffer (in place, or by replacing it).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin

from dptrain.errors import UnsupportedModuleError
from dptrain.layers import (
    DPGRU,
    DPLSTM,
    DPRNN,
    DPGRUCell,
    DPLSTMCell,
    DPMultiheadAttention,
    DPRNNCell,
)

MAX_BUFFERS_LISTED = 5  # buffer paths named by refuse_buffer_updates


@dataclass(frozen=True)
class ModuleProblem:
    """One reason a model cannot be trained privately as it is.

    Attributes:
        path: the submodule's path in the model (``"layer1.0.bn1"``; ``""`` for the model itself).
        problem: what is wrong with it.
        fix: what to do about it.
    """

    path: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'}: {self.problem} Fix: {self.fix}"


@dataclass(frozen=True)
class _Rule:
    """A kind of unsupported module: how to recognise, explain and replace it."""

    applies: Callable[[nn.Module], bool]
    problem: Callable[[nn.Module], str]
    fix: str
    replace: Callable[[nn.Module], nn.Module]


# ---- replacements -----------------------------------------------------------------------------


def _factory_kwargs(module: nn.Module) -> dict[str, object]:
    """device and dtype of the module's first parameter or buffer (empty if it has none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return {"device": tensor.device, "dtype": tensor.dtype}
    return {}


def _carry_over(old: nn.Module, new: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load ``state`` into ``new``; copy the training mode and each parameter's requires_grad.

    ``state`` uses ``old``'s parameter names; a DP layer maps them to its own parameters (one
    torch name may cover several, e.g. ``in_proj_weight``).
    """
    new.load_state_dict(state)
    new.train(old.training)
    new.requires_grad_(False)
    to_internal = getattr(new, "_torch_to_internal", lambda names: names)
    for name, param in old.named_parameters():
        if param.requires_grad:
            for internal in to_internal({name: param}):
                new.get_parameter(internal).requires_grad_(True)
    return new


def _affine_state(norm: nn.Module) -> dict[str, torch.Tensor]:
    """The affine weight and bias ``[C]`` of a norm layer (empty when not affine)."""
    return {name: p.detach() for name, p in norm.named_parameters(recurse=False)}


def _batchnorm_to_groupnorm(bn: nn.Module) -> nn.Module:
    """GroupNorm with ``gcd(32, C)`` groups, same eps, affine parameters carried over."""
    channels = bn.num_features
    groups = math.gcd(32, channels)
    norm = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine, **_factory_kwargs(bn))
    return _carry_over(bn, norm, _affine_state(bn))


def _instancenorm_without_stats(norm: nn.Module) -> nn.Module:
    """Same InstanceNorm class and settings with ``track_running_stats=False``."""
    plain = type(norm)(
        norm.num_features,
        eps=norm.eps,
        momentum=norm.momentum,
        affine=norm.affine,
        track_running_stats=False,
        **_factory_kwargs(norm),
    )
    return _carry_over(norm, plain, _affine_state(norm))


def _rnn_to_dp(rnn: nn.Module) -> nn.Module:
    """The DP recurrent layer with the same arguments, loaded with ``rnn``'s weights."""
    common = {
        "num_layers": rnn.num_layers,
        "bias": rnn.bias,
        "batch_first": rnn.batch_first,
        "dropout": rnn.dropout,
        "bidirectional": rnn.bidirectional,
        **_factory_kwargs(rnn),
    }
    if isinstance(rnn, nn.LSTM):
        layer: nn.Module = DPLSTM(
            rnn.input_size, rnn.hidden_size, proj_size=rnn.proj_size, **common
        )
    elif isinstance(rnn, nn.GRU):
        layer = DPGRU(rnn.input_size, rnn.hidden_size, **common)
    else:
        layer = DPRNN(rnn.input_size, rnn.hidden_size, nonlinearity=rnn.nonlinearity, **common)
    return _carry_over(rnn, layer, rnn.state_dict())


def _cell_to_dp(cell: nn.Module) -> nn.Module:
    """The DP cell with the same arguments, loaded with ``cell``'s weights."""
    kwargs = {"bias": cell.bias, **_factory_kwargs(cell)}
    if isinstance(cell, nn.LSTMCell):
        layer: nn.Module = DPLSTMCell(cell.input_size, cell.hidden_size, **kwargs)
    elif isinstance(cell, nn.GRUCell):
        layer = DPGRUCell(cell.input_size, cell.hidden_size, **kwargs)
    else:
        layer = DPRNNCell(
            cell.input_size, cell.hidden_size, nonlinearity=cell.nonlinearity, **kwargs
        )
    return _carry_over(cell, layer, cell.state_dict())


def _attention_to_dp(mha: nn.MultiheadAttention) -> nn.Module:
    """DPMultiheadAttention with the same arguments, loaded with ``mha``'s weights."""
    layer = DPMultiheadAttention(
        mha.embed_dim,
        mha.num_heads,
        dropout=mha.dropout,
        bias=mha.in_proj_bias is not None,
        add_bias_kv=mha.bias_k is not None,
        add_zero_attn=mha.add_zero_attn,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=mha.batch_first,
        **_factory_kwargs(mha),
    )
    return _carry_over(mha, layer, mha.state_dict())


# ---- rules --------------------------------------------------------------------------------------


def _is_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


_RULES: tuple[_Rule, ...] = (
    _Rule(
        applies=lambda m: isinstance(m, _BatchNorm),
        problem=lambda m: (
            f"{type(m).__name__} mixes the samples of a batch (each is normalised with batch "
            "statistics, so its gradient depends on the others) and its running statistics are "
            "computed from private data and saved without noise; this holds frozen too."
        ),
        fix="replace it by nn.GroupNorm(gcd(32, C), C) (ModuleValidator.fix does this).",
        replace=_batchnorm_to_groupnorm,
    ),
    _Rule(
        applies=lambda m: isinstance(m, _InstanceNorm) and m.track_running_stats,
        problem=lambda m: (
            f"{type(m).__name__} has track_running_stats=True: its running statistics are "
            "updated from private data and saved without noise (frozen or not)."
        ),
        fix="set track_running_stats=False (ModuleValidator.fix does this).",
        replace=_instancenorm_without_stats,
    ),
    _Rule(
        applies=lambda m: isinstance(m, (nn.RNN, nn.LSTM, nn.GRU)) and _is_trainable(m),
        problem=lambda m: (
            f"trainable {type(m).__name__} runs as one fused kernel that gives no per-sample "
            "gradients."
        ),
        fix=(
            "use dptrain.layers.DPLSTM / DPGRU / DPRNN (ModuleValidator.fix swaps it, weights "
            "kept)."
        ),
        replace=_rnn_to_dp,
    ),
    _Rule(
        applies=lambda m: isinstance(m, nn.RNNCellBase) and _is_trainable(m),
        problem=lambda m: (
            f"trainable {type(m).__name__} runs as one fused kernel that gives no per-sample "
            "gradients (and does not run under torch.func.vmap)."
        ),
        fix=(
            "use dptrain.layers.DPLSTMCell / DPGRUCell / DPRNNCell (ModuleValidator.fix swaps "
            "it, weights kept)."
        ),
        replace=_cell_to_dp,
    ),
    _Rule(
        applies=lambda m: isinstance(m, nn.MultiheadAttention) and _is_trainable(m),
        problem=lambda m: (
            "trainable nn.MultiheadAttention runs fused kernels that give no per-sample gradients."
        ),
        fix="use dptrain.layers.DPMultiheadAttention (ModuleValidator.fix swaps it, weights kept).",
        replace=_attention_to_dp,
    ),
)


def _rule_for(module: nn.Module) -> _Rule | None:
    return next((rule for rule in _RULES if rule.applies(module)), None)


# What every caller of ModuleValidator.raise_if_invalid can suggest; the paths listed per kind.
FIX_REMEDY = ("Call `model = dptrain.ModuleValidator.fix(model)` before making it private (it "
              "replaces such submodules by private equivalents and carries the weights over).")
MAX_LISTED = 4


class ModuleValidator:
    """Check a model for DP-SGD and convert the modules that block it."""

    @staticmethod
    def validate(model: nn.Module) -> list[ModuleProblem]:
        """Every problem in ``model``, one per offending submodule, in module order."""
        problems = []
        for path, module in model.named_modules():
            rule = _rule_for(module)
            if rule is not None:
                problems.append(ModuleProblem(path, rule.problem(module), rule.fix))
        return problems

    @staticmethod
    def is_valid(model: nn.Module) -> bool:
        """True when :meth:`validate` finds no problem."""
        return not ModuleValidator.validate(model)

    @staticmethod
    def raise_if_invalid(model: nn.Module, subject: str = "The model",
                         remedy: str = FIX_REMEDY) -> None:
        """Raise `invalid_model_error` (subject, remedy) if `model` has problems."""
        problems = ModuleValidator.validate(model)
        if problems:
            raise invalid_model_error(problems, subject, remedy)

    @staticmethod
    def fix(model: nn.Module, inplace: bool = False) -> nn.Module:
        """Return a model that validates, with the weights of ``model`` carried over.

        BatchNorm -> GroupNorm(gcd(32, C), C) (affine weights kept), InstanceNorm running stats
        off, trainable RNN/LSTM/GRU/MultiheadAttention -> the DP layers. ``model`` is deep-copied
        first unless ``inplace=True`` (then its submodules are replaced where they are; the root
        itself can only be replaced in the returned value). A submodule shared by several parents
        is replaced by one shared module.
        """
        _refuse_uninitialized(model)
        if not inplace:
            model = copy.deepcopy(model)
        root_rule = _rule_for(model)
        if root_rule is not None:
            return root_rule.replace(model)
        _replace_children(model, {})
        ModuleValidator.raise_if_invalid(model)
        return model


def invalid_model_error(problems: list[ModuleProblem] | tuple[ModuleProblem, ...], subject: str,
                        remedy: str = FIX_REMEDY) -> UnsupportedModuleError:
    """The one message of a model that fails validation: "`subject` cannot be trained with
    DP-SGD as it is", every problem grouped by kind with the submodules' paths, and `remedy`
    (what the caller can do: the fix, other choices). The error carries `problems`."""
    by_kind: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        by_kind.setdefault((p.problem, p.fix), []).append(repr(p.path or "<model>"))
    listed = " ".join(
        f"{', '.join(paths[:MAX_LISTED])}{', ...' if len(paths) > MAX_LISTED else ''}"
        f"{f' ({len(paths)} modules)' if len(paths) > 1 else ''}: {problem} Fix: {fix}"
        for (problem, fix), paths in by_kind.items())
    return UnsupportedModuleError(
        f"{subject} cannot be trained with DP-SGD as it is: {listed} {remedy}", problems)


def _refuse_uninitialized(model: nn.Module) -> None:
    """Raise UnsupportedModuleError naming the first lazy module whose shapes are still unknown."""
    for path, module in model.named_modules():
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise UnsupportedModuleError(
                f"ModuleValidator.fix: submodule {path or '<model>'!r} ({type(module).__name__}) "
                "has not been initialised yet, so it cannot be copied or converted; run one "
                "forward pass on a dummy batch first."
            )


def _replace_children(module: nn.Module, replaced: dict[int, nn.Module]) -> None:
    """Swap every offending descendant of ``module`` (depth first); ``replaced`` memoises by id."""
    for name, child in list(module._modules.items()):  # named_children() would skip repeats
        if child is None:
            continue
        if id(child) in replaced:
            setattr(module, name, replaced[id(child)])
            continue
        rule = _rule_for(child)
        if rule is None:
            _replace_children(child, replaced)
            continue
        replaced[id(child)] = rule.replace(child)
        setattr(module, name, replaced[id(child)])


# ---- buffers changed by a training forward ------------------------------------------------------


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference tensors, which have none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def buffer_versions(model: nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """``{buffer path: (buffer, version counter)}`` of every buffer of ``model`` (no copy made;
    holding the tensors keeps a replaced buffer's memory from being reused by its successor)."""
    return {name: (buf, _version(buf)) for name, buf in model.named_buffers()}


def _changed_buffers(before: dict[str, tuple[torch.Tensor, int | None]],
                     after: dict[str, tuple[torch.Tensor, int | None]]) -> list[str]:
    """Paths of the buffers added, removed, replaced or updated in place between two snapshots."""
    def same(name: str) -> bool:
        old, new = before.get(name), after.get(name)
        return old is not None and new is not None and old[0] is new[0] and old[1] == new[1]

    return sorted(name for name in before.keys() | after.keys() if not same(name))


@contextlib.contextmanager
def refuse_buffer_updates(model: nn.Module) -> Iterator[None]:
    """Run a training forward of ``model``; raise UnsupportedModuleError after it if it changed a
    buffer (updated in place, replaced, added or removed), naming the submodule and buffer.

    A buffer computed from private data (a running mean) is released with the model's
    state_dict and checkpoints without noise, and feeds later samples' gradients: DP-SGD's
    guarantee does not cover it.
    """
    before = buffer_versions(model)
    yield
    changed = _changed_buffers(before, buffer_versions(model))
    if changed:
        listed = ", ".join(f"'{name}'" for name in changed[:MAX_BUFFERS_LISTED])
        raise UnsupportedModuleError(
            f"A training forward of the model changed its buffer(s) {listed}: a buffer updated "
            "from the data (e.g. running statistics) is computed from private examples without "
            "noise, is saved with the model's state_dict and checkpoints, and makes later "
            "samples' gradients depend on earlier ones, so DP-SGD's epsilon does not cover it. "
            "Keep buffers fixed while training (compute such statistics from public data "
            "beforehand, or make them trainable parameters), or replace the layer (BatchNorm: "
            "`dptrain.ModuleValidator.fix(model)` swaps in GroupNorm).")

