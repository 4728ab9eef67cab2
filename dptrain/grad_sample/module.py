"""GradSampleModule: per-sample gradients from one forward and one backward pass.

How it works
------------
Every submodule that directly owns a parameter (``parameters(recurse=False)``) gets a forward hook.
While the model is in training mode and grad is enabled, each forward call of such a layer whose
own parameters are trainable is recorded as a :class:`LayerCall` (its detached inputs, the pass it
belongs to) and a tensor hook is put on each differentiable output. The call record lives only in
those hooks' closures, so it is freed with the autograd graph (a forward without backward keeps
nothing) and a layer used twice in one forward pairs each backprop with its own inputs. Tensor
hooks (rather than full backward hooks) also work for a first layer whose input does not require
grad, for in-place operations applied to a layer's output, and for tuple outputs.

On backward the gradient w.r.t. the output (the *backprops*) is moved batch-first, multiplied by
the pass's batch size when ``loss_reduction="mean"``, and handed with the activations to
:meth:`GradSampleModule._on_backprop`. Layers with several differentiable outputs are handled
once the whole backward is done (all their output gradients are known by then).

Hook points for subclasses (the ghost-clipping module, grad_sample/ghost.py, overrides these)
--------------------------------------------------------------------------------
- ``_on_backprop(call, activations, backprops)``: what is computed per layer on backward. The
  default computes the per-sample gradients (:meth:`_per_sample_grads`: the registered grad
  sampler, else the ``torch.func`` fallback) and adds them to ``self._grad_samples``.
- ``_on_backward_end()``: runs once at the end of every backward; the default writes the
  accumulated per-sample gradients to ``p.grad_sample``.
- ``_sync_with_params()``: runs at the start of every backward and clipping-interface call.
- the clipping interface (``per_sample_batch_size``, ``squared_norms``, ``weighted_sum``,
  ``clear_per_sample``, ``check_complete``), contract 1 of docs/architecture.md.

Forward passes: each call of the wrapped model's forward (through the wrapper, or the model
itself) is one :class:`~dptrain.grad_sample.accumulate.ForwardPass`, started by a forward pre-hook
on the model. Its batch size B is read from the call's arguments
(:func:`~dptrain.grad_sample.batch.pass_batch_size`), and every captured layer output must have B
at the batch dimension (:func:`~dptrain.grad_sample.batch.check_batch_dim`). A layer run outside
the model's forward (a submodule or another method called directly) belongs to no pass, so it is
refused as soon as a backward reaches it.

Accumulation: the uses of a layer within a pass SUM; the passes reached by one backward hold the
same examples and SUM too; the passes of separate backwards CONCATENATE in forward order; anything
ambiguous is refused (:class:`~dptrain.grad_sample.accumulate.BackwardRows`,
:class:`~dptrain.grad_sample.accumulate.PerPassStore`).

Safety: every trainable parameter also gets a tensor hook feeding a
:class:`~dptrain.grad_sample.audit.BackwardAudit`, which raises at the end of a backward when a
parameter got a gradient that its per-sample gradients do not explain (used outside its module).
The end-of-backward work runs in a callback queued on the autograd engine by the first hook of
each backward (``Variable._execution_engine.queue_callback``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves

from dptrain.errors import ConfigError, PrivacyError, UnsupportedModuleError
from dptrain.grad_sample.accumulate import BackwardRows, ForwardPass, PerPassStore
from dptrain.grad_sample.audit import BackwardAudit
from dptrain.grad_sample.batch import (
    FlatTokens,
    check_batch_dim,
    check_flat_rows,
    flat_tokens_of,
    pass_batch_size,
    unflatten_tokens,
)
from dptrain.grad_sample.broadcast import BatchProvenance, broadcast_inputs, broadcast_output, broadcast_rule
from dptrain.grad_sample.functorch import functorch_grad_samples
from dptrain.grad_sample.ghost_math import dropped_samples, norm_dtype, sq_norms, weighted_sample_sum
from dptrain.grad_sample.registry import flattens_tokens, get_grad_sampler, get_output_gradient
from dptrain.layers import DPMultiheadAttention, DPRNNBase
from dptrain.validation import ModuleValidator

LOSS_REDUCTIONS = ("mean", "sum")

# Models that currently carry a GradSampleModule's hooks (a weak set: no attribute on the model,
# so a deep copy of a wrapped model is a plain model).
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclass
class UseGroup:
    """The calls of one layer in one pass: ``expected`` uses, ``pending`` (activations, backprops).

    When the layer type has a use merger (``dptrain.grad_sample.ghost_registry``; Linear has one),
    the uses of one backward are folded into one before the per-layer work: a recurrent layer's T
    per-step Linear calls then cost one batched matmul instead of T matmuls and T additions.
    """

    expected: int = 0
    pending: list[tuple[list[Any], Tensor]] = field(default_factory=list)


@dataclass
class LayerCall:
    """One recorded forward call of a hooked layer.

    Attributes:
        layer: the submodule; ``name`` its path in the wrapped model.
        args / kwargs: the call's inputs, tensors detached, in the model's layout (batch at
            ``batch_dim``); ``versions`` their version counters at capture time.
        forward_pass: the forward pass of the wrapped model this call belongs to.
        batch_size: B of that pass.
        out_leaves: positions of the differentiable outputs in ``tree_leaves(output)``;
        out_shapes / out_dtypes: theirs; ``grads``: their gradients once known.
        group: the layer's uses in this pass (see :class:`UseGroup`).
        flat: the flattened tokens when the call ran inside a token-flattening module (its
            per-token tensors have ``B * T`` rows at dim 0, no batch dimension), else None.
    """

    layer: nn.Module
    name: str
    args: tuple
    kwargs: dict
    versions: list[int]
    forward_pass: ForwardPass
    batch_size: int
    out_leaves: list[int]
    out_shapes: list[torch.Size]
    out_dtypes: list[torch.dtype]
    grads: list[Optional[Tensor]] = field(default_factory=list)
    group: UseGroup = field(default_factory=UseGroup)
    flat: Optional[FlatTokens] = None

    @property
    def rows_id(self) -> int:
        """The key of this call's block of examples in the per-sample stores (set on backward)."""
        rows = self.forward_pass.rows
        if rows is None:
            raise RuntimeError(f"the call of '{self.name}' was not reached by a backward yet")
        return rows.id


def _trainable_direct(layer: nn.Module) -> list[nn.Parameter]:
    """The parameters ``layer`` owns itself (not its children's) that require grad, each once.

    Read from ``layer._parameters`` (what ``parameters(recurse=False)`` walks): this runs several
    times per layer and step, and the generator machinery cost more than the rest of the check.
    """
    own: list[nn.Parameter] = []
    for p in layer._parameters.values():
        if p is not None and p.requires_grad and (not own or all(p is not q for q in own)):
            own.append(p)
    return own


def _use_merger(layer: nn.Module) -> Optional[Callable]:
    """The rule folding several uses of ``layer`` into one (``fn(layer, uses) -> use``), or None."""
    import dptrain.grad_sample.ghost  # noqa: F401  (registers the use mergers)
    from dptrain.grad_sample.ghost_registry import get_use_merger

    return get_use_merger(layer)


def validate_model(model: nn.Module) -> None:
    """Raise UnsupportedModuleError listing every submodule that breaks per-sample gradients."""
    ModuleValidator.raise_if_invalid(model, "GradSampleModule(model): the model")


def _adapter_targets(model: nn.Module) -> Optional[str]:
    """The PEFT adapters' target modules of ``model`` (or of a PEFT model inside it), else None.

    Read from the ``peft_config`` attribute PEFT models carry (``{adapter: config}``), so peft is
    never imported here.
    """
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and configs:
            return "; ".join(
                f"adapter '{name}': target_modules={sorted(getattr(c, 'target_modules', None) or [])}, "
                f"modules_to_save={sorted(getattr(c, 'modules_to_save', None) or [])}"
                for name, c in configs.items()
            )
    return None


def check_has_trainable_parameters(model: nn.Module) -> None:
    """Raise ConfigError when no parameter of ``model`` requires grad (nothing to train privately)."""
    if any(p.requires_grad for p in model.parameters()):
        return
    targets = _adapter_targets(model)
    if targets is not None:
        raise ConfigError(
            f"GradSampleModule(model): this PEFT model has no trainable parameter ({targets}): its "
            f"adapters on those modules are frozen. An adapter loaded with "
            f"PeftModel.from_pretrained(...) is frozen unless you pass is_trainable=True; a model "
            f"from peft.get_peft_model(...) trains its adapters unless requires_grad_(False) was "
            f"called on it afterwards. Make the adapters trainable before make_private."
        )
    raise ConfigError(
        "GradSampleModule(model): no parameter of the model requires grad, so there is nothing to "
        "train privately. Unfreeze the parameters to train (requires_grad_(True)) before wrapping."
    )


def _checked_grad_sample(call: LayerCall, param: nn.Parameter, grad_sample: Tensor) -> Tensor:
    """``grad_sample`` in ``param``'s dtype, after checking it is ``[B, *param.shape]``."""
    expected = (call.batch_size, *param.shape)
    if tuple(grad_sample.shape) != expected:
        kind = type(call.layer).__name__
        raise UnsupportedModuleError(
            f"The grad sampler of submodule '{call.name}' ({kind}) returned a per-sample gradient "
            f"of shape {tuple(grad_sample.shape)} for a parameter of shape {tuple(param.shape)}; "
            f"expected {expected} ([B, *param.shape] with B = {call.batch_size}). Fix the function "
            f"registered with @dptrain.register_grad_sampler({kind})."
        )
    return grad_sample.to(param.dtype)


def check_dp_layer_layouts(model: nn.Module, batch_first: bool) -> None:
    """Raise ConfigError if a trainable DP layer's ``batch_first`` differs from the wrapper's.

    A DP recurrent or attention layer feeds its Linear pieces tensors in its own layout, so the
    wrapper must look for the batch there too. Caught at runtime only when the two layouts' sizes
    differ, and silently wrong when, say, an attention layer's sequence length equals the batch
    size: hence this check at wrap time.
    """
    for name, layer in model.named_modules():
        if not isinstance(layer, (DPRNNBase, DPMultiheadAttention)) or layer.batch_first == batch_first:
            continue
        if any(p.requires_grad for p in layer.parameters()):
            raise ConfigError(
                f"Submodule '{name or '<model>'}' ({type(layer).__name__}) has "
                f"batch_first={layer.batch_first}, but GradSampleModule(batch_first={batch_first}) "
                f"looks for the batch at dim {0 if batch_first else 1} of every layer's tensors; "
                f"per-sample gradients would mix samples with positions. Use "
                f"GradSampleModule(model, batch_first={layer.batch_first}) (make_private(..., "
                f"batch_first={layer.batch_first})), or build the layer with "
                f"batch_first={batch_first}."
            )


@functools.lru_cache(maxsize=None)
def _forward_signature(layer_type: type) -> inspect.Signature:
    """Signature of ``layer_type.forward`` without ``self``."""
    signature = inspect.signature(layer_type.forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def positional_inputs(layer: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """The call's inputs in ``forward``'s parameter order (keyword arguments and defaults bound).

    ``emb_bag(x, offsets=o)`` gives ``[x, o, None]`` so samplers can read inputs by position.
    """
    if not kwargs:
        return list(args)
    try:
        bound = _forward_signature(type(layer)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [*args, *kwargs.values()]
    bound.apply_defaults()
    return list(bound.arguments.values())


def bookkeeping() -> contextlib.AbstractContextManager:
    """A context in which torch functions skip every ``__torch_function__`` handler (modes and
    subclasses), for the hooks' own reads and flag changes during a forward pass.

    The pass's :class:`~dptrain.grad_sample.broadcast.BatchProvenance` mode would otherwise see
    each of them (about 90 per mnist_cnn forward, a few microseconds each, against 10 model
    operations); none of them computes a tensor the model goes on with (a shared layer's output
    given the batch dimension is marked explicitly by
    :func:`~dptrain.grad_sample.broadcast.broadcast_output`).
    """
    return torch._C.DisableTorchFunction()


def _tensor_versions(args: tuple, kwargs: dict) -> list[int]:
    """Version counters of every tensor among a call's inputs (nested containers included), in
    ``tree_leaves`` order; a call of plain tensor arguments (the common case) skips the tree walk."""
    if not kwargs and all(type(a) is Tensor for a in args):
        return [a._version for a in args]
    return [t._version for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]


def _detach(value: Any) -> Any:
    """``value`` with every tensor detached (structure kept for lists/tuples/dicts)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)) and not isinstance(value, PackedSequence):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def on_gradient(out: Tensor, hook: Callable[[Tensor], None], after_later_ones: bool) -> None:
    """Call ``hook(grad)`` with the gradient of ``out`` (its shape) in each backward reaching it.

    ``after_later_ones``: after every hook registered on ``out`` itself, even those registered
    later (FSDP's pre-backward hook on a unit's output, which gathers the parameters ``hook``
    reads). Autograd runs the hooks of a tensor before the pre-hooks of the node that made it,
    so ``hook`` becomes a pre-hook of ``out.grad_fn``: no view or copy of ``out`` is handed on (a
    returned view would make an in-place op on the unit's output drop FSDP's hook and break its
    backward; FSDP2 warns of it). Like a tensor hook, a node pre-hook stays with the node when
    the caller modifies ``out`` in place, and gets the gradient of its value before that.
    """
    node = out.grad_fn
    if not after_later_ones or node is None:  # a leaf has no node: its own hooks run in order
        out.register_hook(hook)
        return
    index = out.output_nr

    def pre_hook(grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        if grad_outputs[index] is not None:  # another output of the node got a gradient
            hook(grad_outputs[index])

    node.register_prehook(pre_hook)


class GradSampleModule(nn.Module):
    """Wrap ``model`` so that every trainable parameter gets ``p.grad_sample`` after backward.

    Args:
        model: any ``nn.Module`` that validates (see :class:`dptrain.ModuleValidator`).
        batch_first: True if the batch is dim 0 of the model's input and of every layer's inputs
            and outputs, False if it is dim 1 (sequence-first models); must equal the
            ``batch_first`` of every trainable DP recurrent/attention layer (checked here).
        loss_reduction: ``"mean"`` if the loss averages over the batch (the 1/B is undone so that
            ``p.grad_sample[b]`` is the gradient of sample b's own loss) or ``"sum"``.

    ``p.grad_sample`` has shape ``[B, *p.shape]`` in the parameter's dtype (B summed over the
    blocks of examples since the last :meth:`clear_per_sample`: one block per backward, see
    :mod:`~dptrain.grad_sample.accumulate`).
    """

    #: capture each layer's output gradient after the hooks registered later on that output
    #: (a fully sharded model: FSDP's pre-backward hook on a unit's output gathers the unit's
    #: parameters, which ours read; dptrain.distributed.fsdp), see :func:`on_gradient`
    hooks_after_later_ones = False

    def __init__(self, model: nn.Module, batch_first: bool = True, loss_reduction: str = "mean") -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"GradSampleModule(model) needs an nn.Module, got {type(model).__name__}.")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(
                f"GradSampleModule(loss_reduction={loss_reduction!r}) is not supported: use 'mean' "
                f"if your loss averages over the batch (torch's default) or 'sum' if it sums."
            )
        if model in _WRAPPED:
            raise ConfigError(
                "GradSampleModule(model): this model is already wrapped; wrap it once, or call "
                "remove_hooks() on the previous wrapper first."
            )
        validate_model(model)
        check_has_trainable_parameters(model)
        check_dp_layer_layouts(model, batch_first)
        self._module = model
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self._batch_dim = 0 if batch_first else 1
        self._grad_samples = PerPassStore()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks_enabled = False
        self._capture_paused = False
        self._passes_started = 0
        self._eval_pass_with_grad = False   # a forward in eval mode with gradients on, since the
                                            # last training-mode forward (nothing captured)
        self._pass: Optional[ForwardPass] = None
        self._model_depth = 0  # nesting of the wrapped model's forward calls (0: outside)
        self._provenance: Optional[BatchProvenance] = None  # active during a pass's forward
        # token-flattening modules running now, innermost last (None: one running outside a pass)
        self._flat_tokens: list[Optional[FlatTokens]] = []
        self._rows = BackwardRows()
        self._in_backward = False
        self._backward_refusal: Optional[str] = None  # see refuse_backward
        self._deferred: dict[int, LayerCall] = {}
        self._open_groups: dict[int, LayerCall] = {}
        self._audit = BackwardAudit({id(p): n for n, p in self.model_parameters()})
        self._add_hooks()

    # ------------------------------------------------------------------ wrapper plumbing
    #: The hooks' book-keeping, rewritten about a dozen times a step: set as plain attributes.
    #: nn.Module.__setattr__ first looks each name up among the parameters, submodules and buffers
    #: (none of these names is ever one of them), a cost that shows on small models.
    _PLAIN_STATE = frozenset({
        "_model_depth", "_passes_started", "_eval_pass_with_grad", "_pass", "_provenance",
        "_in_backward", "_deferred", "_open_groups", "_capture_paused", "_hooks_enabled",
    })

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._PLAIN_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model unchanged (the call is a new forward pass, see
        :meth:`_enter_model`). A training forward that changes a buffer of the model raises
        UnsupportedModuleError (:func:`dptrain.validation.refuse_buffer_updates`)."""
        if not self._module.training:
            return self._module(*args, **kwargs)
        from dptrain.validation import refuse_buffer_updates  # lazy: it imports the DP layers

        with refuse_buffer_updates(self._module):
            return self._module(*args, **kwargs)

    def _enter_model(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the wrapped model: an outermost call starts a new forward pass.

        The pass's batch size is read from the call's arguments here, the one place that
        decides it (:func:`~dptrain.grad_sample.batch.pass_batch_size`).
        """
        if self._capture_paused:  # a re-run of the model as a layer (torch.func, ghost vjp)
            return
        if self._model_depth == 0:
            self._passes_started += 1
            self._eval_pass_with_grad = not model.training and (
                self._eval_pass_with_grad or torch.is_grad_enabled())
            with bookkeeping():
                batch = pass_batch_size(model, args, kwargs, self.batch_first)
            self._pass = ForwardPass(id=self._passes_started, batch=batch, backwards_before=self._rows.completed)
            if model.training or torch.is_grad_enabled():  # else nothing is captured: no cost
                self._provenance = BatchProvenance(args, kwargs)
                self._provenance.__enter__()
        self._model_depth += 1

    def _leave_model(self, model: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of the wrapped model (also run when its forward raised)."""
        if self._capture_paused:
            return
        self._model_depth -= 1
        if self._model_depth == 0 and self._provenance is not None:
            self._provenance.__exit__(None, None, None)
            self._provenance = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__["_modules"].get("_module")
            if name == "_module" or wrapped is None:
                raise
            return getattr(wrapped, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict (same keys as the unwrapped model)."""
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the unwrapped model (same keys)."""
        return self._module.load_state_dict(state_dict, strict=strict, assign=assign)

    def model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, param)`` of the parameter objects the layers use in forward and backward, each
        once, in model order: the wrapped model's own. A sharded model (FSDP2) registers other
        objects while its layers run (its gathered parameters): its wrapper
        (:mod:`dptrain.distributed.fsdp`) overrides this to return those."""
        return list(self._module.named_parameters())

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, param)`` of every parameter with requires_grad, in model order."""
        return [(n, p) for n, p in self.model_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ hooks
    def _add_hooks(self) -> None:
        """Hook every submodule that directly owns parameters (trainability checked per call),
        and every trainable parameter (for the :class:`~dptrain.grad_sample.audit.BackwardAudit`)."""
        for name, layer in self._module.named_modules():
            if next(layer.parameters(recurse=False), None) is None:
                continue
            hook = partial(self._capture, name)
            self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        # After the layer hooks: a model that is itself a layer captures before its pass closes.
        self._handles.append(self._module.register_forward_pre_hook(self._enter_model, with_kwargs=True))
        self._handles.append(self._module.register_forward_hook(self._leave_model, always_call=True))
        for name, layer in self._module.named_modules():  # after the model's: its pass has begun
            if flattens_tokens(layer):
                self._handles.append(layer.register_forward_pre_hook(partial(self._enter_flattening, name)))
                self._handles.append(layer.register_forward_hook(self._leave_flattening, always_call=True))
        for _, param in self.model_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(partial(self._on_param_grad, param)))
        self._hooks_enabled = True
        _WRAPPED.add(self._module)

    def remove_hooks(self) -> None:
        """Detach all hooks: the model behaves as plain torch afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooks_enabled = False
        _WRAPPED.discard(self._module)

    def _enter_flattening(self, name: str, layer: nn.Module, args: tuple) -> None:
        """Forward pre-hook of a token-flattening module: the layers it calls take the batch's
        tokens flattened (:class:`~dptrain.grad_sample.batch.FlatTokens`, read from its input)."""
        if self._model_depth == 0 or self._capture_paused or self._pass is None:
            self._flat_tokens.append(None)  # outside a pass: nothing is captured
            return
        with bookkeeping():
            x = args[0] if args else None
            self._flat_tokens.append(flat_tokens_of(name, x, self._pass.batch, self.batch_first))

    def _leave_flattening(self, layer: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of a token-flattening module (also run when its forward raised)."""
        if self._flat_tokens:
            self._flat_tokens.pop()

    def _capturing(self, layer: nn.Module) -> bool:
        """Whether a forward call of ``layer`` must be recorded now."""
        return (
            self._hooks_enabled
            and not self._capture_paused
            and torch.is_grad_enabled()
            and layer.training
            and bool(_trainable_direct(layer))
        )

    def _capture(self, name: str, layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook: record the call and hook its differentiable outputs.

        Returns the output given the batch dimension when the call's inputs are shared by the
        batch (:mod:`~dptrain.grad_sample.broadcast`), else None (output unchanged).

        The recording runs with torch-function handling off (:func:`bookkeeping`): its reads of shapes and
        flags and its detached copies are not model computation for the pass's provenance mode.
        """
        with bookkeeping():
            replaced = self._record(name, layer, args, kwargs, output)
        return replaced

    def _record(self, name: str, layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The body of :meth:`_capture`."""
        if not self._capturing(layer):
            return None
        leaves = [output] if type(output) is Tensor else tree_leaves(output)  # one tensor: no walk
        out_leaves = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        outputs = [leaves[i] for i in out_leaves]
        if not outputs:
            return None
        forward_pass = self._pass if self._model_depth > 0 else None
        if forward_pass is None:  # refused if a backward reaches it (see _refuse_outside_call)
            for out in outputs:
                out.register_hook(partial(self._refuse_outside_call, name))
            return None
        flat = self._flat_tokens[-1] if self._flat_tokens else None
        if flat is not None:  # rows of the batch's flattened tokens: none of them is shared
            replaced, batch = None, check_flat_rows(name, outputs, flat)
        else:
            args, kwargs, replaced = self._broadcast_shared_inputs(name, layer, args, kwargs, output)
            if replaced is not None:
                outputs = [replaced]
            batch = self._check_output_batch(name, outputs)
        call = LayerCall(
            layer=layer,
            name=name,
            args=_detach(args),
            kwargs=_detach(kwargs),
            versions=_tensor_versions(args, kwargs),
            forward_pass=forward_pass,
            batch_size=batch,
            out_leaves=out_leaves,
            out_shapes=[t.shape for t in outputs],
            out_dtypes=[t.dtype for t in outputs],
            grads=[None] * len(outputs),
            group=forward_pass.uses.get(id(layer)) or forward_pass.uses.setdefault(id(layer), UseGroup()),
            flat=flat,
        )
        call.group.expected += 1
        for index, out in enumerate(outputs):
            on_gradient(out, partial(self._on_output_grad, call, index), self.hooks_after_later_ones)
        return replaced

    def _broadcast_shared_inputs(
        self, name: str, layer: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> tuple[tuple, dict, Optional[Tensor]]:
        """``(args, kwargs, output)`` given the pass's batch dimension when the whole batch shares
        the call's inputs (:func:`~dptrain.grad_sample.broadcast.broadcast_rule`, read from the
        pass's :class:`~dptrain.grad_sample.broadcast.BatchProvenance`), else the inputs unchanged
        and None. Views only: nothing is copied."""
        batch, dim = self._pass.batch, self._batch_dim
        if self._provenance is None:  # untracked pass (eval under no_grad): nothing is shared
            return args, kwargs, None
        inputs = [t for t in tree_leaves(positional_inputs(layer, args, kwargs)) if isinstance(t, Tensor)]
        rule = broadcast_rule(name, inputs, output, batch, dim)
        if rule is None:
            return args, kwargs, None
        args, kwargs = broadcast_inputs((args, kwargs), rule, inputs[0], batch, dim)
        return args, kwargs, broadcast_output(name, output, rule, batch.size, dim)

    def _refuse_outside_call(self, name: str, grad: Tensor) -> None:
        """Tensor hook on the output of a layer call made outside the model's forward."""
        if not self._hooks_enabled:
            return
        self._abort_backward()
        raise UnsupportedModuleError(
            f"Submodule '{name}' was run in training mode outside the wrapped model's forward (e.g. "
            f"gsm.{name.split('.')[0]}(x), or another method such as gsm.encode(x)) and a backward "
            f"reached it. The number of examples of a forward pass is read from the arguments of "
            f"the model's forward, and one call of it is one pass; a layer run on its own has "
            f"neither, so its per-sample gradients cannot be formed safely. Call the wrapper "
            f"(gsm(x)) and let the model's forward dispatch to the submodule or method you need, "
            f"or wrap that submodule on its own."
        )

    def _check_output_batch(self, name: str, outputs: list[Tensor]) -> int:
        """Return the pass's B after checking every output has it at the batch dimension."""
        return check_batch_dim(name, outputs, self._pass.batch, self.batch_first)

    def _on_output_grad(self, call: LayerCall, index: int, grad: Tensor) -> None:
        """Tensor hook on the ``index``-th differentiable output of ``call``."""
        if not self._hooks_enabled:
            return
        self._begin_backward()
        try:
            if len(call.grads) == 1:
                self._dispatch(call, [grad])
            else:
                call.grads[index] = grad
                self._deferred[id(call)] = call
        except Exception:
            self._abort_backward()
            raise

    def _abort_backward(self) -> None:
        """Forget the state of a backward that raised (its end callback will not run)."""
        self._in_backward = False
        self._deferred = {}
        for call in self._open_groups.values():
            call.group.pending.clear()
        self._open_groups = {}
        self._audit.reset()
        self._rows.end_backward()

    def _on_param_grad(self, param: nn.Parameter, grad: Tensor) -> None:
        """Tensor hook on a parameter: autograd computed its gradient in this backward."""
        if not self._hooks_enabled:
            return
        self._begin_backward()
        self._audit.received(param, grad)

    def refuse_backward(self, reason: Optional[str]) -> None:
        """Make every backward raise PrivacyError(`reason`) at its first hook, before anything is
        captured (None: allow backward again). The DP optimizer sets it while per-sample
        gradients of an earlier batch wait for a step (dptrain.privacy.optimizer,
        `refuse_at_backward`)."""
        self._backward_refusal = reason

    def _begin_backward(self) -> None:
        """On the first hook of a backward: sync with params and schedule the end callback
        (or raise the refusal `refuse_backward` set, with nothing captured)."""
        if self._in_backward:
            return
        if self._backward_refusal is not None:
            raise PrivacyError(self._backward_refusal)
        self._in_backward = True
        self._sync_with_params()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Runs once after each backward: deferred multi-output layers, then the subclass hook."""
        try:
            deferred, self._deferred = self._deferred, {}
            for call in deferred.values():
                grads = [
                    g if g is not None else torch.zeros(s, dtype=d, device=self._device(call))
                    for g, s, d in zip(call.grads, call.out_shapes, call.out_dtypes)
                ]
                call.grads = [None] * len(call.grads)
                self._dispatch(call, grads)
            for call in list(self._open_groups.values()):  # uses that got no gradient
                self._flush_group(call)
            self._on_backward_end()
            self._audit.finish()
        finally:
            self._abort_backward()

    @staticmethod
    def _device(call: LayerCall) -> torch.device:
        """Device of the layer's own parameters (for zero gradients of unused outputs)."""
        return next(call.layer.parameters(recurse=False)).device

    def _dispatch(self, call: LayerCall, grads: list[Tensor]) -> None:
        """Join the call's pass to this backward's block of examples (:class:`BackwardRows`), put
        activations and backprops batch-first, rescale, and call :meth:`_on_backprop`."""
        self._rows.rows_of(call.forward_pass)
        self._check_inputs_unchanged(call)
        self._audit.covered(_trainable_direct(call.layer))
        backprops = [self._batch_first(call, g) for g in grads]
        if self.loss_reduction == "mean":
            backprops = [g * call.batch_size for g in backprops]
        inputs = positional_inputs(call.layer, call.args, call.kwargs)
        activations = [self._batch_first(call, a) if isinstance(a, Tensor) else a for a in inputs]
        fold = get_output_gradient(call.layer) if len(backprops) > 1 else None
        if fold is not None:  # several outputs, one use in the form the layer's rules read
            activations, folded = fold(call.layer, activations, tuple(backprops))
            backprops = [folded]
        if not self._merges_uses(call, len(backprops)):
            self._on_backprop(call, activations, backprops[0] if len(backprops) == 1 else tuple(backprops))
        else:
            call.group.pending.append((activations, backprops[0]))
            self._open_groups[id(call.group)] = call
            if len(call.group.pending) == call.group.expected:
                self._flush_group(call)
        # The call stays reachable from its output's autograd node until the whole backward ends;
        # dropping its inputs here lets each activation be freed as soon as its layer is done
        # (as plain autograd frees its saved tensors), instead of all of them living to the end.
        call.args, call.kwargs = (), {}

    def _batch_first(self, call: LayerCall, t: Tensor) -> Tensor:
        """A per-sample tensor of ``call`` with the batch at dim 0: moved there, or, for a call on
        flattened tokens, its ``B * T`` rows unflattened to ``[B, T, ...]`` (other tensors as they
        are)."""
        if call.flat is None:
            # batch-first (dim 0): t itself, not a movedim(0, 0) view (one kernel call less per
            # tensor, layer and step)
            return t.movedim(self._batch_dim, 0) if self._batch_dim and t.dim() > self._batch_dim else t
        if t.dim() == 0 or t.shape[0] != call.flat.rows:
            return t
        return unflatten_tokens(t, call.flat, self.batch_first)

    @staticmethod
    def _merges_uses(call: LayerCall, num_outputs: int) -> bool:
        """Whether this use waits to be folded with the layer's other uses in the pass.

        Only single-output layers used several times with a non-empty batch and a use merger do
        (an empty batch has nothing to merge: each use goes straight to :meth:`_on_backprop`).
        """
        return (
            num_outputs == 1
            and call.group.expected > 1
            and call.batch_size > 0
            and _use_merger(call.layer) is not None
        )

    def _flush_group(self, call: LayerCall) -> None:
        """Fold the pending uses of ``call``'s group into one and run :meth:`_on_backprop` on it."""
        uses, call.group.pending = call.group.pending, []
        del self._open_groups[id(call.group)]
        activations, backprops = _use_merger(call.layer)(call.layer, uses)
        self._on_backprop(call, activations, backprops)

    @staticmethod
    def _check_inputs_unchanged(call: LayerCall) -> None:
        """Raise if an input of the call was modified in place after the forward."""
        now = _tensor_versions(call.args, call.kwargs)
        if now != call.versions:
            raise UnsupportedModuleError(
                f"An input of submodule '{call.name}' was modified in place after its forward call, "
                f"so its stored activations no longer match the gradients. Replace the in-place "
                f"operation on that input (e.g. `x.relu_()` or `x += ...`) by its out-of-place form."
            )

    # ------------------------------------------------------------------ per-layer computation
    def _on_backprop(self, call: LayerCall, activations: list[Any], backprops: Tensor | tuple[Tensor, ...]) -> None:
        """Default per-layer work on backward: per-sample gradients, accumulated per block.

        Args:
            call: the forward call these gradients belong to (``call.layer``; ``call.rows_id`` the
                block of examples its pass fills).
            activations: the call's positional inputs, batch dimension first.
            backprops: gradient of each sample's own loss w.r.t. the output, ``[B, *out]``
                (a tuple for layers with several differentiable outputs).
        """
        loss_scale = 1.0 / max(call.batch_size, 1) if self.loss_reduction == "mean" else 1.0
        for param, grad_sample in self._per_sample_grads(call, activations, backprops).items():
            self._grad_samples.add(param, call.rows_id, grad_sample)
            self._audit.contribution(param, grad_sample, loss_scale)

    def _per_sample_grads(
        self, call: LayerCall, activations: list[Any], backprops: Tensor | tuple[Tensor, ...]
    ) -> dict[nn.Parameter, Tensor]:
        """``{param: Tensor[B, *param.shape]}`` for the layer's trainable own parameters.

        In the parameter's dtype: under autocast the backprops are half precision, but clipping
        must weigh and sum the per-sample gradients in the parameter's precision.
        """
        trainable = _trainable_direct(call.layer)
        if call.batch_size == 0:  # an empty (Poisson) batch: no sample, nothing to compute
            return {p: p.new_zeros((0, *p.shape)) for p in trainable}
        sampler = get_grad_sampler(call.layer)
        if sampler is not None and isinstance(backprops, Tensor):
            grads = sampler(call.layer, activations, backprops)
        else:
            grads = self._fallback_grads(call, backprops)
        own = [(p, g) for p, g in grads.items() if any(p is t for t in trainable)]
        return {p: _checked_grad_sample(call, p, g) for p, g in own}

    def _fallback_grads(self, call: LayerCall, backprops: Tensor | tuple[Tensor, ...]) -> dict[nn.Parameter, Tensor]:
        """Per-sample gradients by ``torch.func`` for a layer without a registered sampler.

        Refused for a call on flattened tokens: the re-run finds each sample's rows by the batch
        dimension, which those tensors do not have."""
        if call.flat is not None:
            kind = type(call.layer).__name__
            raise UnsupportedModuleError(
                f"Submodule '{call.name}' ({kind}) runs on the batch's flattened tokens inside "
                f"'{call.flat.block}' and has no grad sampler for its outputs, so its per-sample "
                f"gradients cannot be formed (the torch.func fallback needs a batch dimension). "
                f"Freeze its parameters (requires_grad_(False)), or register rules for {kind} "
                f"(dptrain.register_grad_sampler; several outputs also need "
                f"dptrain.grad_sample.registry.register_output_gradient)."
            )
        grads = (backprops,) if isinstance(backprops, Tensor) else backprops
        self._capture_paused = True
        try:
            return functorch_grad_samples(
                call.layer, call.args, call.kwargs, grads, call.out_leaves, self._batch_dim, call.name
            )
        finally:
            self._capture_paused = False

    def _on_backward_end(self) -> None:
        """Write the accumulated per-sample gradients to ``p.grad_sample``."""
        for param, grad_sample in self._grad_samples.materialize().items():
            param.grad_sample = grad_sample

    def _sync_with_params(self) -> None:
        """Forget stored rows of parameters whose ``grad_sample`` was cleared from outside."""
        for param in list(self._grad_samples.keys()):
            if getattr(param, "grad_sample", None) is None:
                self._grad_samples.discard(param)

    # ------------------------------------------------------------------ clipping interface
    def per_sample_batch_size(self) -> int:
        """Number of samples captured since the last clear (over all blocks; 0 if none)."""
        self._sync_with_params()
        return self._grad_samples.batch_size()

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        """``{p: Tensor[B]}``, each sample's squared L2 norm of its gradient for ``p``.

        A trainable parameter that got no per-sample gradient (unused in every captured pass) has
        zero gradient for every sample. In :func:`~dptrain.grad_sample.ghost_math.norm_dtype`:
        float32 for 16-bit parameters (a norm rounded to 16 bits can come out below the norm of the
        gradient it clips).
        """
        batch = self.per_sample_batch_size()
        norms = {}
        for _, p in self.trainable_parameters():
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                norms[p] = torch.zeros(batch, dtype=norm_dtype(p), device=p.device)
            else:
                norms[p] = sq_norms(gs.reshape(batch, -1))
        return norms

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """``{p: sum_b weights[p][b] * grad_sample_b(p)}``, shape ``p.shape``, in
        :func:`~dptrain.grad_sample.ghost_math.norm_dtype` (float32 for 16-bit parameters).

        One matrix-vector product per parameter on a view of ``p.grad_sample``: nothing larger than
        the result is allocated (16-bit parameters: their rows are converted to float32 by chunks,
        each at most the result's size or 16 MiB, see
        :func:`~dptrain.grad_sample.ghost_math.weighted_sample_sum`). A sample with a zero weight
        is left out: its values never reach the sum, even NaN ones
        (:func:`~dptrain.grad_sample.ghost_math.dropped_samples`).
        """
        batch = self.per_sample_batch_size()
        captured = {p: getattr(p, "grad_sample", None) for p in weights}
        for p, w in weights.items():
            if captured[p] is not None and w.shape != (batch,):
                raise ConfigError(
                    f"weighted_sum(weights): the weights of a parameter of shape {tuple(p.shape)} "
                    f"have shape {tuple(w.shape)}; expected ({batch},), one weight per sample."
                )
        dropped = dropped_samples({p: w for p, w in weights.items() if captured[p] is not None})
        return {p: torch.zeros_like(p, dtype=norm_dtype(p)) if gs is None
                else weighted_sample_sum(gs.reshape(batch, -1), weights[p], dropped).view(p.shape)
                for p, gs in captured.items()}

    def refuse_uncaptured_gradients(self) -> None:
        """For a step that found no per-sample gradients: raise UnsupportedModuleError when the
        model is in eval mode and gradients came from a forward run in it (nothing was
        captured), rather than let the step treat the batch as empty and release noise alone.
        Stale gradients of an earlier step with no forward since are no error."""
        if self._eval_pass_with_grad and not self._module.training:
            self._refuse_eval_mode([name for name, p in self.trainable_parameters()
                                    if p.grad is not None])

    def _refuse_eval_mode(self, missing: list[str]) -> None:
        """When the gradients of `missing` arrived uncaptured because the whole model is in eval
        mode: say so and how to fix it (the step would otherwise drop them and release noise
        alone)."""
        if missing and not self._module.training:
            raise UnsupportedModuleError(
                f"Parameters {missing} received a gradient but no per-sample gradient: the model "
                "is in eval mode (model.eval(), or Hugging Face's from_pretrained, which returns "
                "models in eval mode), so nothing was captured and the step would release noise "
                "alone. Call model.train() before training (and model.eval() only around "
                "evaluation).")

    def clear_per_sample(self) -> None:
        """Free every per-sample gradient captured so far (``p.grad_sample = None``)."""
        for _, p in self.model_parameters():
            p.grad_sample = None
        self._grad_samples.reset()

    def zero_grad_sample(self) -> None:
        """Set ``p.grad_sample = None`` for all parameters (same as :meth:`clear_per_sample`)."""
        self.clear_per_sample()

    def check_complete(self) -> None:
        """Raise UnsupportedModuleError if a trainable param has ``.grad`` but no per-sample grad."""
        missing = [
            name
            for name, p in self.trainable_parameters()
            if p.grad is not None and getattr(p, "grad_sample", None) is None
        ]
        if missing:
            self._refuse_eval_mode(missing)
            raise UnsupportedModuleError(
                f"Parameters {missing} received a gradient but no per-sample gradient. This happens "
                f"when a parameter is used outside the forward of the module that owns it (e.g. "
                f"`self.fc.weight @ x` in a parent's forward: call `self.fc(x)` or move the "
                f"parameter into its own module), when that module ran in eval mode or under "
                f"torch.no_grad(), or when the model was called after remove_hooks()."
            )
