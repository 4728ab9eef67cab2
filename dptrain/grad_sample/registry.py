"""Registry of per-layer grad samplers and norm samplers.

A *grad sampler* computes, for one layer and one backward pass, the per-sample gradient of every
parameter the layer owns directly::

    @register_grad_sampler(nn.Linear)
    def linear_sampler(layer, activations, backprops) -> dict[nn.Parameter, Tensor]:
        ...  # each value has shape [B, *p.shape]

``activations`` is the list of the layer's positional forward inputs (batch dimension first) and
``backprops`` the gradient of the loss w.r.t. the layer's output (batch dimension first, already
rescaled so that it is the gradient of each sample's *own* loss).

A *norm sampler* (ghost clipping) has the same arguments and returns, per parameter, the
per-sample SQUARED L2 norm of its gradient, shape [B], without forming the gradient where cheaper.

Lookup walks the layer type's MRO, so a sampler registered for ``nn.Linear`` also serves its
subclasses unless they have their own. The last registration for a type wins.

A type may also be named by its qualified class name (``"transformers.pytorch_utils.Conv1D"``:
``cls.__module__ + "." + cls.__qualname__``). The rules for third-party layers are registered
that way, so that dptrain never imports a library (transformers, peft) the model does not use.

Two properties of a layer type change what its rules receive, for every mode alike:

- a *token-flattening* module (``register_token_flattening``: a mixture-of-experts block) runs its
  children on the batch's tokens flattened in the model's layout (``x.view(-1, H)`` of
  ``[B, T, H]``: row ``r`` belongs to sample ``r // T``). Every layer called inside its forward may
  then have ``B * T`` rows instead of B; its inputs and output gradients with those rows reach its
  rules as ``[B, T, ...]``, so a Linear over the flattened tokens gets the Linear rules.
- an *output-gradient* rule (``register_output_gradient``: ``fn(layer, activations, grads) ->
  (activations, backprops)``) folds the gradients of a layer's several differentiable outputs into
  the one use its rules read (a router returns logits and the top-k weights, both functions of one
  ``x W^T``: the rule gives that product's gradient, and the router gets Linear-like rules).
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

GradSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]
NormSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]

LayerKey = type | str  # a layer class, or its qualified name "package.module.ClassName"

OutputGradient = Callable[[nn.Module, list[Tensor], tuple[Tensor, ...]], tuple[list[Tensor], Tensor]]

GRAD_SAMPLERS: dict[LayerKey, GradSampler] = {}
NORM_SAMPLERS: dict[LayerKey, NormSampler] = {}
OUTPUT_GRADIENTS: dict[LayerKey, OutputGradient] = {}
TOKEN_FLATTENING: dict[LayerKey, bool] = {}


def qualified_name(cls: type) -> str:
    """``"package.module.ClassName"`` of a class (the key of a by-name registration)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_types(decorator: str, types: tuple[LayerKey, ...]) -> None:
    """Raise TypeError unless ``types`` is a non-empty tuple of nn.Module subclasses or of
    qualified class names (a string with a dot)."""
    if not types:
        raise TypeError(f"{decorator}() needs at least one layer type, e.g. {decorator}(nn.Linear).")
    for t in types:
        if isinstance(t, str) and "." in t:
            continue
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(
                f"{decorator}() takes nn.Module subclasses or their qualified names, got {t!r}; "
                f"pass the layer class itself, e.g. {decorator}(MyLayer), or "
                f"{decorator}(\"package.module.MyLayer\")."
            )


def _register(table: dict[LayerKey, Callable], decorator: str, types: tuple[LayerKey, ...]) -> Callable:
    """Return a decorator that stores its function in ``table`` under every type in ``types``."""
    _check_types(decorator, types)

    def wrap(fn: Callable) -> Callable:
        for t in types:
            table[t] = fn
        return fn

    return wrap


def register_grad_sampler(*types: LayerKey) -> Callable[[GradSampler], GradSampler]:
    """Decorator: use the decorated function as the grad sampler of each layer type in ``types``.

    The function takes ``(layer, activations: list[Tensor], backprops: Tensor)`` and returns
    ``{param: Tensor[B, *param.shape]}``. The last registration for a type wins.
    """
    return _register(GRAD_SAMPLERS, "register_grad_sampler", types)


def register_norm_sampler(*types: LayerKey) -> Callable[[NormSampler], NormSampler]:
    """Decorator: use the decorated function as the norm sampler of each layer type in ``types``.

    The function takes ``(layer, activations, backprops)`` and returns ``{param: Tensor[B]}``, the
    per-sample SQUARED L2 norms. The last registration for a type wins.
    """
    return _register(NORM_SAMPLERS, "register_norm_sampler", types)


def register_output_gradient(*types: LayerKey) -> Callable[[OutputGradient], OutputGradient]:
    """Decorator: the decorated ``fn(layer, activations, grads) -> (activations, backprops)`` folds
    the output gradients of a layer with several differentiable outputs (``grads``, each batch
    first) into one use ``(activations, backprops: Tensor)``, the form its other rules read."""
    return _register(OUTPUT_GRADIENTS, "register_output_gradient", types)


def register_token_flattening(*types: LayerKey) -> None:
    """Declare that each module type in ``types`` runs its children on the batch's tokens flattened
    in the model's layout: its forward reshapes its first input ``[B, T, ..., H]`` (batch first;
    ``[T, B, ..., H]`` sequence first) to ``[B * T * ..., H]`` in that order, and every layer it
    calls with trainable parameters takes and returns tensors of those rows. Only declare it for a
    module whose forward does exactly that: the rows' samples are read from that order."""
    _check_types("register_token_flattening", types)
    for t in types:
        TOKEN_FLATTENING[t] = True


def _lookup(table: dict[LayerKey, Callable], layer_type: type) -> Optional[Callable]:
    """Return the entry of the first class in ``layer_type``'s MRO present in ``table`` (by the
    class itself, else by its qualified name)."""
    for cls in layer_type.__mro__:
        if cls in table:
            return table[cls]
        entry = table.get(qualified_name(cls))
        if entry is not None:
            return entry
    return None


def get_grad_sampler(layer: nn.Module | type) -> Optional[GradSampler]:
    """The grad sampler for a layer (instance or type), walking the MRO; None if there is none."""
    _ensure_builtin_samplers()
    return _lookup(GRAD_SAMPLERS, layer if isinstance(layer, type) else type(layer))


def get_norm_sampler(layer: nn.Module | type) -> Optional[NormSampler]:
    """The norm sampler for a layer (instance or type), walking the MRO; None if there is none."""
    _ensure_builtin_samplers()
    return _lookup(NORM_SAMPLERS, layer if isinstance(layer, type) else type(layer))


def get_output_gradient(layer: nn.Module) -> Optional[OutputGradient]:
    """The output-gradient rule of ``layer`` (MRO walk), or None."""
    _ensure_builtin_samplers()
    return _lookup(OUTPUT_GRADIENTS, type(layer))


def flattens_tokens(layer: nn.Module) -> bool:
    """Whether ``layer``'s type was declared token-flattening (MRO walk)."""
    _ensure_builtin_samplers()
    return _lookup(TOKEN_FLATTENING, type(layer)) is not None


_BUILTINS_LOADED = False


def _ensure_builtin_samplers() -> None:
    """Import the built-in samplers once, before the first lookup."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import dptrain.grad_sample  # noqa: F401  (registers linear/conv/embedding/norm samplers)
