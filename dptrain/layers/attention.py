"""DPMultiheadAttention: ``nn.MultiheadAttention`` built from ``nn.Linear`` pieces.

The query/key/value input projections are three ``nn.Linear`` modules (``q_proj``, ``k_proj``,
``v_proj``), the output projection is ``out_proj``, and ``bias_k`` / ``bias_v`` live in two
:class:`~dptrain.layers.linear.SequenceBias` modules (``key_bias``, ``value_bias``), so the
per-sample gradient engine covers every parameter. The attention itself (scores, masks, softmax,
dropout) is computed per sample and owns no parameters.

All projections see tensors in the layer's layout (``[B, L, E]`` if ``batch_first`` else
``[L, B, E]``): wrap the model with ``GradSampleModule(model, batch_first=<the layer's>)``.
``state_dict`` keys are torch's (``in_proj_weight``/``in_proj_bias`` or
``q_proj_weight``/``k_proj_weight``/``v_proj_weight``, ``bias_k``, ``bias_v``, ``out_proj.*``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dptrain.errors import ConfigError
from dptrain.layers._state_dict import StateDict, TorchStateDictMixin
from dptrain.layers.linear import SequenceBias

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class DPMultiheadAttention(TorchStateDictMixin):
    """Drop-in ``nn.MultiheadAttention`` whose per-sample gradients the engine can compute.

    Args are those of ``torch.nn.MultiheadAttention``: ``embed_dim`` (E), ``num_heads`` (must
    divide E), ``dropout`` on the attention weights, ``bias``, ``add_bias_kv``,
    ``add_zero_attn``, ``kdim``/``vdim`` (key/value feature sizes, default E), ``batch_first``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_attention_args(embed_dim, num_heads, dropout)
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        kwargs = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kwargs)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **kwargs)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **kwargs)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kwargs)
        self.key_bias = SequenceBias(embed_dim, batch_first, **kwargs) if add_bias_kv else None
        self.value_bias = SequenceBias(embed_dim, batch_first, **kwargs) if add_bias_kv else None
        self._reset_projections()
        self._install_torch_naming()

    def _reset_projections(self) -> None:
        """Torch's initialisation: Xavier-uniform on the (stacked) input projection, zero biases."""
        if self._qkv_same_embed_dim:
            stacked = torch.empty_like(
                torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            )
            nn.init.xavier_uniform_(stacked)
            with torch.no_grad():
                for name, chunk in zip(_PROJECTIONS, stacked.chunk(3)):
                    getattr(self, name).weight.copy_(chunk)
        else:
            for name in _PROJECTIONS:
                nn.init.xavier_uniform_(getattr(self, name).weight)
        for name in (*_PROJECTIONS, "out_proj"):
            if getattr(self, name).bias is not None:
                nn.init.zeros_(getattr(self, name).bias)

    # ---- torch-compatible read-only views ------------------------------------------------

    @property
    def bias_k(self) -> torch.Tensor | None:
        """``[1, 1, E]`` learned key appended to the keys, or None (as torch)."""
        return None if self.key_bias is None else self.key_bias.bias

    @property
    def bias_v(self) -> torch.Tensor | None:
        """``[1, 1, E]`` learned value appended to the values, or None (as torch)."""
        return None if self.value_bias is None else self.value_bias.bias

    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """``[3E, E]`` stacked q/k/v weights when kdim == vdim == E (as torch), else None."""
        if not self._qkv_same_embed_dim:
            return None
        return torch.cat([getattr(self, name).weight for name in _PROJECTIONS])

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """``[3E]`` stacked q/k/v biases, or None when ``bias=False`` (as torch)."""
        if self.q_proj.bias is None:
            return None
        return torch.cat([getattr(self, name).bias for name in _PROJECTIONS])

    def merge_masks(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        query: torch.Tensor,
    ) -> tuple[torch.Tensor | None, int | None]:
        """Torch's mask merging, used by ``nn.TransformerEncoderLayer``'s fused inference path.

        In eval mode without autograd that path runs torch's fused kernel on
        :attr:`in_proj_weight` / :attr:`in_proj_bias` (the same function; no gradients involved).
        """
        return nn.MultiheadAttention.merge_masks(self, attn_mask, key_padding_mask, query)  # type: ignore[arg-type]

    # ---- forward -------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Multi-head attention, numerically as ``nn.MultiheadAttention``.

        Args:
            query: ``[B, L, E]`` (batch_first) or ``[L, B, E]``, or unbatched ``[L, E]``.
            key, value: ``[B, S, kdim]`` / ``[B, S, vdim]`` in the same layout.
            key_padding_mask: ``[B, S]``; bool (True = ignore this key) or float (added).
            attn_mask: ``[L, S]`` or ``[B * num_heads, L, S]``; bool (True = not allowed) or
                float (added to the scores).
            is_causal: apply a causal mask; used to build one when ``attn_mask`` is None
                (torch requires the mask; here it is optional).

        Returns:
            ``(output [B, L, E] in the input layout, weights or None)``; weights are
            ``[B, L, S']`` averaged over heads, or ``[B, num_heads, L, S']`` (S' counts the
            bias_k and zero-attention positions).
        """
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(self._batch_dim) for t in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        self._check_inputs(query, key, value)
        q, k, v = self._project(query, key, value)
        mask = self._merged_mask(q, k, key_padding_mask, attn_mask, is_causal)
        context, weights = self._attend(q, k, v, mask)
        output = self.out_proj(self._swap_layout(context))
        if need_weights:
            weights = weights.mean(dim=1) if average_attn_weights else weights
        else:
            weights = None
        if unbatched:
            output = output.squeeze(self._batch_dim)
            weights = None if weights is None else weights.squeeze(0)
        return output, weights

    @property
    def _batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    def _swap_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Layer layout <-> batch-first (a transpose when ``batch_first=False``; self-inverse)."""
        return x if self.batch_first else x.transpose(0, 1)

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input projections (+ bias_k/bias_v, + zero attention), split into heads.

        Returns q ``[B, H, L, hd]``, k and v ``[B, H, S', hd]``.
        """
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self.key_bias is not None and self.value_bias is not None:
            k, v = self.key_bias(k), self.value_bias(v)
        q, k, v = (self._split_heads(self._swap_layout(t)) for t in (q, k, v))
        if self.add_zero_attn:
            k, v = (
                torch.cat([t, t.new_zeros(t.shape[:2] + (1, t.shape[3]))], dim=2) for t in (k, v)
            )
        return q, k, v

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, E]`` -> ``[B, H, L, hd]``."""
        batch, length, _ = x.shape
        return x.reshape(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled dot-product attention per sample and head.

        Returns the context ``[B, L, E]`` and the weights it used ``[B, H, L, S']``: post-softmax,
        after attention dropout in training mode (what ``nn.MultiheadAttention`` returns).
        """
        scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        dropped = (
            F.dropout(weights, p=self.dropout, training=self.training)
            if self.dropout > 0
            else weights
        )
        context = (dropped @ v).transpose(1, 2)  # [B, L, H, hd]
        return context.reshape(context.shape[0], context.shape[1], self.embed_dim), dropped

    def _merged_mask(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor | None:
        """One additive float mask broadcastable to ``[B, H, L, S']``, or None."""
        batch, _, length, _ = q.shape
        source = k.shape[2]
        extra = source - self._num_keys_before_extras(k)
        if attn_mask is None and is_causal:
            allowed = torch.ones(length, source - extra, dtype=torch.bool, device=q.device)
            attn_mask = allowed.triu(1)  # True above the diagonal: future keys are masked
        masks = []
        if attn_mask is not None:
            attn_mask = _additive(attn_mask, q.dtype, "attn_mask")
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.reshape(batch, self.num_heads, length, -1)
            masks.append(F.pad(attn_mask, (0, extra)))
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, q.dtype, "key_padding_mask")
            masks.append(F.pad(padding, (0, extra)).reshape(batch, 1, 1, source))
        if not masks:
            return None
        return masks[0] if len(masks) == 1 else masks[0] + masks[1]

    def _num_keys_before_extras(self, k: torch.Tensor) -> int:
        """S: keys given by the caller, without the bias_k and zero-attention positions."""
        return k.shape[2] - int(self.key_bias is not None) - int(self.add_zero_attn)

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        expected = {"query": self.embed_dim, "key": self.kdim, "value": self.vdim}
        for name, tensor in zip(expected, (query, key, value)):
            if tensor.dim() != 3 or tensor.shape[-1] != expected[name]:
                layout = "[B, L, features]" if self.batch_first else "[L, B, features]"
                raise ConfigError(
                    f"DPMultiheadAttention: `{name}` has shape {tuple(tensor.shape)}, expected "
                    f"{layout} with features={expected[name]} (embed_dim/kdim/vdim), or the "
                    f"unbatched [L, features] form for all three inputs. Check `batch_first`."
                )
        if (
            key.shape[:2] != value.shape[:2]
            or query.shape[self._batch_dim] != key.shape[self._batch_dim]
        ):
            raise ConfigError(
                "DPMultiheadAttention: `query`, `key` and `value` must share the batch size and "
                f"`key`/`value` the sequence length; got {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}."
            )

    # ---- state_dict naming ---------------------------------------------------------------

    def _torch_key_of(self, key: str) -> str:
        module, _, param = key.partition(".")
        if module in _PROJECTIONS:
            if param == "bias":
                return "in_proj_bias"
            return "in_proj_weight" if self._qkv_same_embed_dim else f"{module}_weight"
        return {"key_bias.bias": "bias_k", "value_bias.bias": "bias_v"}.get(key, key)

    def _internal_to_torch(self, local: StateDict) -> StateDict:
        """Stacks q/k/v into ``in_proj_*`` (not one to one, unlike the recurrent layers)."""
        result: StateDict = {}
        weights = [local.pop(f"{name}.weight") for name in _PROJECTIONS]
        if self._qkv_same_embed_dim:
            result["in_proj_weight"] = torch.cat(weights)
        else:
            result.update({f"{name}_weight": w for name, w in zip(_PROJECTIONS, weights)})
        if f"{_PROJECTIONS[0]}.bias" in local:
            result["in_proj_bias"] = torch.cat([local.pop(f"{name}.bias") for name in _PROJECTIONS])
        for torch_name, module_name in (("bias_k", "key_bias"), ("bias_v", "value_bias")):
            if f"{module_name}.bias" in local:
                result[torch_name] = local.pop(f"{module_name}.bias")
        return {**result, **local}

    def _torch_to_internal(self, local: StateDict) -> StateDict:
        result: StateDict = {}
        for packed, suffix in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
            if packed in local:
                chunks = local.pop(packed).chunk(3)
                result.update({f"{name}.{suffix}": c for name, c in zip(_PROJECTIONS, chunks)})
        for name in _PROJECTIONS:
            if f"{name}_weight" in local:
                result[f"{name}.weight"] = local.pop(f"{name}_weight")
        for torch_name, module_name in (("bias_k", "key_bias"), ("bias_v", "value_bias")):
            if torch_name in local:
                result[f"{module_name}.bias"] = local.pop(torch_name)
        return {**result, **local}

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"kdim={self.kdim}, vdim={self.vdim}, add_zero_attn={self.add_zero_attn}, "
            f"batch_first={self.batch_first}"
        )


def _additive(mask: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Bool mask (True = masked) -> float mask with -inf; float masks are cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    if not torch.is_floating_point(mask):
        raise ConfigError(
            f"DPMultiheadAttention: `{name}` must be a bool mask (True = not allowed) or a float "
            f"mask added to the scores; got dtype {mask.dtype}."
        )
    return mask.to(dtype)


def _check_attention_args(embed_dim: int, num_heads: int, dropout: float) -> None:
    """Raise ConfigError naming the first constructor argument that cannot be used."""
    if not (isinstance(embed_dim, int) and embed_dim > 0):
        raise ConfigError(
            f"DPMultiheadAttention: `embed_dim`={embed_dim!r} must be a positive int."
        )
    if not (isinstance(num_heads, int) and num_heads > 0 and embed_dim % num_heads == 0):
        raise ConfigError(
            f"DPMultiheadAttention: `num_heads`={num_heads!r} must be a positive int dividing "
            f"embed_dim={embed_dim}."
        )
    if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1):
        raise ConfigError(f"DPMultiheadAttention: `dropout`={dropout!r} must be in [0, 1].")
