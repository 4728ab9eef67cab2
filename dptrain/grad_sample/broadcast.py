"""Layers whose input is shared by the whole batch (broadcast inputs).

The batch size B of a pass is read from the wrapped model's own input
(:func:`~dptrain.grad_sample.batch.pass_batch_size`), not from whichever layer runs first.

A layer with trainable parameters may be applied to a tensor that every sample shares: HF's
position ids ``[1, T]``, nanoGPT's ``wpe(arange(T))`` (``[T]``: no batch dimension), a learned query
``[1, D]``. Its output is then broadcast over the batch by the next operation, and autograd sums
the gradient over the samples before the layer's hook sees it: the per-sample gradients are lost.
The wrapper gives such an output the batch dimension (a view: ``expand`` of the size-1 dimension,
or a new dimension expanded to B), so the next operation no longer broadcasts and the gradient
reaching the hook is per sample. This is exactly the layer run on its inputs expanded to the batch
(each sample's row depends on that sample's row only, which per-sample gradients assume anyway);
the call's recorded inputs are expanded the same way for the grad sampler.

Which calls are shared is decided by provenance, not by shape (shapes cannot tell ``arange(T)``
from one sample's ids, nor a ``[T, F]`` buffer from a batch when T == B). During each captured
forward pass :class:`BatchProvenance` marks every tensor computed from the model's tensor
arguments; a tensor made inside the forward from constants, buffers and parameters only
(``torch.arange``, ``self.position_ids[:, :T]``, a learned query) is unmarked. A call is shared
when neither its tensor inputs nor its output are marked (:func:`broadcast_rule`); its layout then
says how it meets the batch:

* first input of at most one dimension (``arange(T)``, even when T == B or T == 1): no batch
  dimension, one is inserted (batch-first models; a sequence-first model must reshape it to
  ``[T, 1]`` itself, since torch aligns a tensor without batch dimension by its trailing
  dimensions, which an inserted dimension 1 would break);
* a batch dimension of size 1 (``[1, T]``, ``[1, D]``): expanded to B;
* a batch dimension of size B that is already an expansion (stride 0, ``ids.expand(B, T)`` as
  BERT does for its token types): an ordinary call, each row is its sample's;
* anything else (a ``[T, F]`` buffer, a ``repeat``-ed copy, a layer without tensor input) cannot be
  told from a batch by its shape and is refused with :class:`~dptrain.errors.UnsupportedModuleError`.

A marked input is per-sample data whatever its shape: a layer applied to ``x[:1]``,
``x.mean(0, keepdim=True)`` or ``x[0]`` is left to the wrapper's batch check, which refuses it
(its rows are not the examples: it mixes samples), except where its rows happen to number B
(``x[0]`` of ``[B, T, F]`` with T == B), which no shape can tell from a batch. So are the tensor
arguments of the model's forward, even position ids ``[1, T]`` a caller passes in.

The expanded output is marked as a :class:`BroadcastView`: each row must reach its own sample only.
An operation on it that indexes its batch dimension (``wpe(ids)[0]``) or returns a tensor without
it (``pos.mean(0)``, ``pos.unsqueeze(0)``) is refused naming the layer, since the gradients of all
samples would reach one row; a reduction whose result still has B rows there by coincidence
(``pos.mean(0)`` with T == B) is not caught.

Provenance is lost where a tensor leaves torch (``x.tolist()``, ``x.numpy()``, ``.item()``): a
tensor rebuilt from such values counts as shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.batch import PassBatch

EXPAND = "expand"  # the inputs have batch size 1: expand that dimension to B
PREPEND = "prepend"  # the inputs have no batch dimension: insert one, expanded to B

_MARK = "_dptrain_from_batch"  # attribute set on tensors computed from a model's arguments


@dataclass(frozen=True)
class BroadcastView:
    """The mark of a shared layer's output given the batch dimension (:func:`broadcast_tensor`).

    Such a view carries the batch like a tensor computed from the model's inputs, and every
    operation applied to it must keep that dimension (checked by :class:`BatchProvenance`).
    """

    name: str  # the layer's path
    size: int  # B
    batch_dim: int


def _provenance(value: Any) -> Any:
    """The mark found in ``value`` (nested tuples, lists, dicts): a :class:`BroadcastView` if a
    tensor carries one, else True if a tensor is computed from the batch, else None."""
    if isinstance(value, Tensor):
        return getattr(value, _MARK, None)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return None
    found = None
    for item in value:
        # a tensor's mark read here rather than by a recursive call: this runs for every torch
        # call of a tracked forward (thousands a step for a recurrent model)
        mark = getattr(item, _MARK, None) if isinstance(item, Tensor) else _provenance(item)
        if isinstance(mark, BroadcastView):
            return mark
        found = found or mark
    return found


def _mark(value: Any, mark: Any = True) -> None:
    """Mark every tensor in ``value`` (a tensor, or nested tuples, lists, dicts)."""
    if isinstance(value, Tensor):
        setattr(value, _MARK, mark)
        return
    if type(value) in (tuple, list):  # chunk(), split(): the same leaves, without a pytree walk
        for item in value:
            _mark(item, mark)
        return
    for leaf in tree_leaves(value):
        if isinstance(leaf, Tensor):
            setattr(leaf, _MARK, mark)


def _mark_written(t: Any) -> None:
    """Mark a tensor an operation wrote into, and the tensor it is a view of."""
    if isinstance(t, Tensor):
        _mark([t] if t._base is None else [t, t._base])


_IN_PLACE_OPERATORS = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
_WRITING_DUNDERS = frozenset(f"__i{op}__" for op in (*_IN_PLACE_OPERATORS, "lshift", "rshift")) | {"__setitem__"}


def _mutates(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``copy_``, ``x += v``, ``x[i] = v``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _WRITING_DUNDERS


def _indexes_batch(func: Any, args: tuple, batch_dim: int) -> bool:
    """Whether ``func`` is ``t[index]`` with an index that picks from dimension ``batch_dim``
    (anything but a full slice ``:`` there: ``t[0]``, ``t[:1]``, ``t[mask]``)."""
    if getattr(func, "__name__", "") != "__getitem__" or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    dim = 0
    for entry in index:
        if entry is Ellipsis:
            return False
        if entry is None:
            continue
        if dim == batch_dim:
            return not (isinstance(entry, slice) and entry == slice(None))
        dim += 1
    return False


def _check_keeps_batch(view: BroadcastView, func: Any, args: tuple, out: Any) -> None:
    """Raise if an operation on a broadcast view indexes its batch dimension or returns a tensor
    without it."""
    indexed = _indexes_batch(func, args, view.batch_dim)
    for leaf in tree_leaves(out):
        if isinstance(leaf, Tensor) and (indexed or not _has_size(leaf, view.batch_dim, view.size)):
            raise UnsupportedModuleError(
                f"The output of submodule '{view.name}' is shared by every example (its input does "
                f"not depend on the model's inputs), so per-sample gradients give it the batch "
                f"dimension: it reaches the rest of the forward expanded to {view.size} rows at dim "
                f"{view.batch_dim}. The operation {getattr(func, '__name__', func)!r} then returned a "
                f"tensor of shape {tuple(leaf.shape)} without that dimension (indexing, reducing or "
                f"reshaping across it), which would credit one example with the others' gradients. "
                f"Combine the layer's output with the batch by broadcasting (e.g. tok_emb + pos_emb) "
                f"and drop a size-1 dimension from its input rather than its output (e.g. "
                f"wpe(position_ids[0]) instead of wpe(position_ids)[0])."
            )


class BatchProvenance(TorchFunctionMode):
    """Marks, during one forward pass, every tensor computed from the model's tensor arguments.

    Entered when the wrapped model's forward starts and left when it returns. Every torch function
    (operators, ``torch.*``, ``nn.functional``, tensor methods) whose arguments include a marked
    tensor marks its outputs; one that writes into a tensor (in place, ``out=``) marks it too. An
    operation on a :class:`BroadcastView` must keep its batch dimension.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        _mark((args, kwargs))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = _provenance(args) or (_provenance(kwargs) if kwargs else None)
        if found is None:
            return out
        if isinstance(found, BroadcastView):
            _check_keeps_batch(found, func, args, out)
        if isinstance(out, Tensor):  # the usual output, marked without the call to _mark
            setattr(out, _MARK, True)
        else:
            _mark(out)
        if _mutates(func) and args:
            _mark_written(args[0])
        if kwargs.get("out") is not None:
            for written in tree_leaves(kwargs["out"]):
                _mark_written(written)
        return out


def from_batch(t: Tensor) -> bool:
    """Whether ``t`` carries the batch: computed from the model's arguments in a tracked pass
    (:class:`BatchProvenance`), or a shared output given the batch dimension."""
    return bool(getattr(t, _MARK, None))


def _has_size(t: Tensor, dim: int, size: int) -> bool:
    """Whether ``t`` has a dimension ``dim`` of ``size``."""
    return t.dim() > dim and t.shape[dim] == size


def _refuse(name: str, shape: tuple[int, ...], batch_dim: int, why: str) -> UnsupportedModuleError:
    """The error for a shared call whose batch dimension cannot be told (``why``: one sentence)."""
    return UnsupportedModuleError(
        f"Submodule '{name}' was applied to an input of shape {shape} that does not depend on the "
        f"model's inputs (every example shares it: it was made inside the forward from constants, "
        f"buffers or parameters; dptrain follows torch operations, a tensor rebuilt from .tolist() "
        f"or .numpy() loses the link), and {why} Per-sample gradients need such a layer to know which "
        f"dimension is the batch: give its input a batch dimension of size 1 at dim {batch_dim} "
        f"(e.g. position ids [1, T], feats.unsqueeze({batch_dim})), expand it to the batch with "
        f".expand() (not .repeat()), or, for a batch-first model, pass 1-D position ids (arange(T))."
    )


def broadcast_rule(
    name: str, inputs: list[Any], output: Any, batch: Optional[PassBatch], batch_dim: int
) -> Optional[str]:
    """:data:`EXPAND`, :data:`PREPEND` or None (an ordinary call, left to the batch check).

    Args:
        name: the submodule's path (for errors).
        inputs: the layer call's inputs in ``forward``'s parameter order.
        output: the call's output (a single tensor can be broadcast).
        batch: the pass's batch (None when it is not known: nothing is broadcast).
        batch_dim: 0 for batch-first models, 1 for sequence-first.

    Raises:
        UnsupportedModuleError: a shared call whose batch dimension cannot be told (module doc).
    """
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, Tensor)]
    if batch is None or batch.size is None or not isinstance(output, Tensor):
        return None
    if from_batch(output) or any(from_batch(t) for t in tensors):
        return None
    first = tensors[0] if tensors else None
    if first is None:
        raise _refuse(name, tuple(output.shape), batch_dim, "the layer took no tensor input to expand.")
    if first.dim() <= 1 and batch_dim == 0:
        return PREPEND
    if _has_size(first, batch_dim, 1) and _has_size(output, batch_dim, 1):
        return EXPAND
    if _has_size(first, batch_dim, batch.size) and first.stride(batch_dim) == 0:
        return None
    if first.dim() <= batch_dim:
        why = f"it has no dim {batch_dim} (a sequence-first model cannot insert a batch dimension)."
    else:
        why = (
            f"its dim {batch_dim} (size {first.shape[batch_dim]}) is neither a batch dimension of "
            f"size 1 nor an expansion to the batch, so it could be read as one row per example."
        )
    raise _refuse(name, tuple(first.shape), batch_dim, why)


def broadcast_tensor(t: Tensor, rule: str, size: int, batch_dim: int) -> Tensor:
    """``t`` with a batch dimension of ``size`` at ``batch_dim`` (a view, no copy)."""
    if rule == PREPEND:
        t = t.unsqueeze(batch_dim)
    shape = list(t.shape)
    shape[batch_dim] = size
    return t.expand(shape)


def broadcast_output(name: str, output: Tensor, rule: str, size: int, batch_dim: int) -> Tensor:
    """The shared layer output ``output`` given the batch dimension, marked as a
    :class:`BroadcastView` (the rest of the forward must keep that dimension)."""
    view = broadcast_tensor(output, rule, size, batch_dim)
    _mark(view, BroadcastView(name, size, batch_dim))
    return view


def broadcast_inputs(values: Any, rule: str, first: Any, batch: PassBatch, batch_dim: int) -> Any:
    """The call's inputs (a pytree) given the batch dimension: with :data:`EXPAND` every tensor
    of batch size 1, with :data:`PREPEND` the first input ``first``."""
    leaves, spec = tree_flatten(values)
    out = []
    for leaf in leaves:
        if isinstance(leaf, Tensor) and (
            (rule == EXPAND and leaf.dim() > batch_dim and leaf.shape[batch_dim] == 1)
            or (rule == PREPEND and leaf is first)
        ):
            leaf = broadcast_tensor(leaf, rule, batch.size, batch_dim)
        out.append(leaf)
    return tree_unflatten(out, spec)
