"""The batch size of a forward pass, and the check that every per-sample tensor agrees with it.

Per-sample gradients give one row per *example*. Which axis holds the examples is read from the
wrapped model's input, never from a layer: a model that moves the batch axis internally (e.g.
transposes ``[B, T, F]`` to sequence-first ``[T, B, F]`` before its layers) would otherwise get one
clipped row per time step, and one example would contribute T clipped gradients.

The rule (:func:`pass_batch_size`): B is the size at the batch dimension (dim 0 with
``batch_first=True``, dim 1 otherwise) of the FIRST tensor argument of the model's forward that
has that dimension, looking at the positional arguments, then the keyword arguments in the order
they were passed, nested lists, tuples and dicts in order. So ``model(x, mask)`` reads ``x``;
a Hugging Face model called as ``model(input_ids=ids, attention_mask=mask)`` reads ``input_ids``;
a tensor with too few dimensions (a 0-d temperature, a 1-d ``lengths`` with ``batch_first=False``)
is skipped; a ``PackedSequence`` gives its batch size (``batch_sizes[0]``). The other arguments
are not compared with it (masks such as a ``[T, T]`` causal mask need not be batched); what is
enforced is that every layer with trainable parameters sees B examples (:func:`check_batch_dim`).
One exception, torch's own input convention: a model that IS an ``nn.EmbeddingBag`` called with
1-D ids and ``offsets`` holds one example per bag. A larger model taking such a flattened batch
must take a per-example tensor (e.g. its offsets) as its first argument.

Flattened tokens: inside the forward of a token-flattening module (a mixture-of-experts block,
:func:`~dptrain.grad_sample.registry.register_token_flattening`) the layers run on the batch's
tokens flattened in the model's layout, ``[B * T, ...]``. There every layer output must have
``B * T`` rows instead (:func:`check_flat_rows`), and its per-token tensors are given back the
batch dimension, ``[B, T, ...]``, before its rules see them (:func:`unflatten_tokens`).

The check (:func:`check_batch_dim`): the output of every captured layer call (and so its output
gradient, which autograd gives the output's shape) must have B at the batch dimension; otherwise
:class:`~dptrain.errors.UnsupportedModuleError` names the submodule and the fix. A layer whose
batch axis has the same size as another axis cannot be told apart by shapes (a transposing model
with T == B): the check catches a moved batch axis whenever the sizes differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from dptrain.errors import UnsupportedModuleError


@dataclass(frozen=True)
class PassBatch:
    """The batch size of one forward pass and where it was read (for error messages).

    Attributes:
        size: B, or None when the forward got no tensor with a batch dimension.
        source: the argument it was read from, e.g. ``"args[0]"`` or ``"kwargs['input_ids']"``.
    """

    size: Optional[int]
    source: str


def _batch_dim(batch_first: bool) -> int:
    return 0 if batch_first else 1


def _first_batched(value: Any, path: str, dim: int) -> Optional[PassBatch]:
    """The first tensor in ``value`` (depth first, in order) with a dimension ``dim``."""
    if isinstance(value, PackedSequence):
        return PassBatch(int(value.batch_sizes[0]) if value.batch_sizes.numel() else 0, path)
    if isinstance(value, Tensor):
        return PassBatch(value.shape[dim], path) if value.dim() > dim else None
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for item_path, item in items:
        found = _first_batched(item, item_path, dim)
        if found is not None:
            return found
    return None


def _flat_bags(model: nn.EmbeddingBag, args: tuple, kwargs: dict) -> Optional[PassBatch]:
    """The number of bags of an EmbeddingBag called with 1-D ids and offsets, else None."""
    ids = args[0] if args else kwargs.get("input")
    offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    if not (isinstance(ids, Tensor) and ids.dim() == 1 and isinstance(offsets, Tensor)):
        return None
    return PassBatch(offsets.shape[0] - int(model.include_last_offset), "offsets (one example per bag)")


def pass_batch_size(model: nn.Module, args: tuple, kwargs: dict, batch_first: bool) -> PassBatch:
    """B of a forward pass of the wrapped ``model``, from its call arguments (the rule above)."""
    if isinstance(model, nn.EmbeddingBag):
        found = _flat_bags(model, args, kwargs)
        if found is not None:
            return found
    dim = _batch_dim(batch_first)
    found = _first_batched(list(args), "args", dim) or _first_batched(kwargs, "kwargs", dim)
    return found if found is not None else PassBatch(None, "")


def check_batch_dim(name: str, tensors: Sequence[Tensor], batch: PassBatch, batch_first: bool) -> int:
    """Return B after checking that every per-sample tensor of a layer call has it.

    Args:
        name: the submodule's path in the wrapped model.
        tensors: the call's differentiable outputs (their gradients have the same shapes).
        batch: the pass's batch size (:func:`pass_batch_size`).
        batch_first: the wrapper's layout (batch at dim 0, else dim 1).

    Raises:
        UnsupportedModuleError: the pass has no batch size, or a tensor has no batch dimension or
            another size there.
    """
    dim = _batch_dim(batch_first)
    layout = f"GradSampleModule(batch_first={batch_first})"
    if batch.size is None:
        raise UnsupportedModuleError(
            f"Submodule '{name}' ran in a forward pass whose arguments hold no tensor with "
            f"a batch dimension (dim {dim} with {layout}), so the number of examples in the pass "
            f"is unknown and per-sample gradients cannot be formed. Pass the batch as a tensor "
            f"argument of the model's forward (e.g. model(x) or model(input_ids=...))."
        )
    for out in tensors:
        if out.dim() <= dim:
            raise UnsupportedModuleError(
                f"Submodule '{name}' returned a tensor of shape {tuple(out.shape)} with no "
                f"batch dimension (dim {dim} with {layout}); per-sample gradients need every layer "
                f"with trainable parameters to keep the batch dimension. Feed it batched inputs, "
                f"or check the wrapper's batch_first."
            )
        if out.shape[dim] != batch.size:
            raise UnsupportedModuleError(
                f"Submodule '{name}' produced an output of shape {tuple(out.shape)} whose "
                f"batch dimension (dim {dim} with {layout}) has size {out.shape[dim]}, but the "
                f"model was called with a batch of {batch.size} examples (dim {dim} of its "
                f"argument {batch.source}). Its per-sample gradients would be one row per "
                f"position, not per example, and one example would be clipped several times. "
                f"Keep the batch at dim {dim} in every layer with trainable parameters: do not "
                f"transpose to another layout or fold time into the batch (view(B*T, ...)) before "
                f"such a layer; build its layers in the input's layout (e.g. batch_first="
                f"{batch_first} recurrent/attention layers), or if the model takes and keeps the "
                f"batch at dim {1 - dim}, wrap it with GradSampleModule(batch_first={not batch_first})"
                f" (make_private(..., batch_first={not batch_first})). An input that every example "
                f"shares (made inside the forward from constants, buffers or parameters, not from its "
                f"arguments) may have a batch dimension of size 1 (e.g. position ids [1, T]): the "
                f"layer's output is then expanded to the batch."
            )
    return batch.size


@dataclass(frozen=True)
class FlatTokens:
    """The batch's tokens as a token-flattening module flattened them.

    Attributes:
        block: the module's path (for errors).
        batch: B; ``tokens``: T, the tokens per sample (rows per sample of the flattened tensors).
    """

    block: str
    batch: int
    tokens: int

    @property
    def rows(self) -> int:
        """``B * T``: the rows of every flattened tensor."""
        return self.batch * self.tokens


def flat_tokens_of(name: str, x: Any, batch: PassBatch, batch_first: bool) -> FlatTokens:
    """The :class:`FlatTokens` of a token-flattening module called with first input ``x``
    ``[B, T, ..., H]`` (``[T, B, ..., H]`` sequence first): T is the product of its dims other than
    the batch dim and the last.

    Raises:
        UnsupportedModuleError: ``x`` is not a tensor with the pass's B at the batch dimension.
    """
    dim = _batch_dim(batch_first)
    if batch.size is None or not isinstance(x, Tensor) or x.dim() < 2 or x.dim() <= dim or x.shape[dim] != batch.size:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise UnsupportedModuleError(
            f"Submodule '{name}' flattens the batch's tokens before its layers (a mixture-of-experts "
            f"block), so the sample of each flattened row is read from its first input, which must "
            f"have the batch of {batch.size} examples at dim {dim} and the features last; it got "
            f"{shape}. Call it on the hidden states [B, T, H] of the batch (batch_first="
            f"{batch_first})."
        )
    tokens = 1
    for i, size in enumerate(x.shape[:-1]):
        if i != dim:
            tokens *= size
    return FlatTokens(name, batch.size, tokens)


def check_flat_rows(name: str, tensors: Sequence[Tensor], flat: FlatTokens) -> int:
    """Return B after checking that every output of a layer called inside a token-flattening
    module has its ``B * T`` flattened rows at dim 0.

    Raises:
        UnsupportedModuleError: an output with another number of rows (not one row per token).
    """
    for out in tensors:
        if out.dim() == 0 or out.shape[0] != flat.rows:
            raise UnsupportedModuleError(
                f"Submodule '{name}' runs inside '{flat.block}', which flattens the batch's tokens "
                f"({flat.batch} examples x {flat.tokens} tokens = {flat.rows} rows), but it returned "
                f"a tensor of shape {tuple(out.shape)} without those rows at dim 0, so its rows "
                f"cannot be assigned to examples. Inside such a module, call layers with trainable "
                f"parameters on the flattened tokens [{flat.rows}, features] only."
            )
    return flat.batch


def unflatten_tokens(t: Tensor, flat: FlatTokens, batch_first: bool) -> Tensor:
    """``t`` ``[B * T, ...]`` (rows in the model's layout) as ``[B, T, ...]`` (a view)."""
    if batch_first:
        return t.unflatten(0, (flat.batch, flat.tokens))
    return t.unflatten(0, (flat.tokens, flat.batch)).movedim(1, 0)
