"""DPRNNCell, DPLSTMCell, DPGRUCell: single-step cells built from two ``nn.Linear`` pieces.

Drop-in replacements for ``nn.RNNCell`` / ``nn.LSTMCell`` / ``nn.GRUCell`` (same constructor
arguments, forward signature and ``state_dict`` keys ``weight_ih``, ``weight_hh``, ``bias_ih``,
``bias_hh``). Torch's cells are fused kernels with no per-sample view (they do not run under
``torch.func.vmap`` either); these compute ``ih(x)`` and ``hh(h)`` with ``RNNLinear`` submodules
and share the step functions of :mod:`dptrain.layers.rnn_cells` with the sequence layers. A cell
called T times in one forward gets the sum of its T uses' per-sample gradients from the engine.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.layers._arguments import check_rnn_args, elman_mode
from dptrain.layers._state_dict import StateDict, TorchStateDictMixin, rename_key
from dptrain.layers.linear import RNNLinear
from dptrain.layers.rnn_cells import CELLS

_INTERNAL_KEY = re.compile(r"^(ih|hh)\.(weight|bias)$")
_TORCH_KEY = re.compile(r"^(weight|bias)_(ih|hh)$")
_TORCH_ORDER = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

CellState = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class DPRNNCellBase(TorchStateDictMixin):
    """Shared implementation of the DP cells; ``mode`` is a key of ``rnn_cells.CELLS``.

    Submodules ``ih`` (``input_size -> G * hidden_size``) and ``hh``
    (``hidden_size -> G * hidden_size``), G gates.
    """

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_rnn_args(type(self).__name__, input_size, hidden_size)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        self._cell = CELLS[mode]
        gates = self._cell.num_gates * hidden_size
        self.ih = RNNLinear(input_size, gates, bias=bias, device=device, dtype=dtype)
        self.hh = RNNLinear(hidden_size, gates, bias=bias, device=device, dtype=dtype)
        self.reset_parameters()
        self._install_torch_naming()

    def reset_parameters(self) -> None:
        """Torch's initialisation: every parameter ~ U(-1/sqrt(H), 1/sqrt(H)), H = hidden_size."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def forward(self, input: torch.Tensor, hx: CellState | None = None) -> CellState:
        """One step.

        Args:
            input: ``[B, input_size]`` or unbatched ``[input_size]``.
            hx: ``h`` ``[B, hidden_size]`` (``(h, c)`` for the LSTM cell); zeros when None.

        Returns:
            the new ``h`` (``(h, c)`` for the LSTM cell), batched like ``input``.
        """
        unbatched = input.dim() == 1
        if unbatched:
            input = input.unsqueeze(0)
            hx = None if hx is None else tuple(t.unsqueeze(0) for t in _as_tuple(hx))
        self._check_input(input)
        state = self._state(input, hx)
        new_state = self._cell.step(self.ih(input), self.hh(state[0]), state)
        if unbatched:
            new_state = tuple(t.squeeze(0) for t in new_state)
        return new_state if self._cell.has_cell_state else new_state[0]

    def _state(self, input: torch.Tensor, hx: CellState | None) -> tuple[torch.Tensor, ...]:
        """The state tuple, zeros when ``hx`` is None; ConfigError on a wrong shape."""
        count = 2 if self._cell.has_cell_state else 1
        shape = (input.shape[0], self.hidden_size)
        if hx is None:
            return tuple(input.new_zeros(shape) for _ in range(count))
        state = _as_tuple(hx)
        if len(state) != count or any(tuple(t.shape) != shape for t in state):
            form = "a tuple (h, c)" if count == 2 else "one tensor h"
            raise ConfigError(
                f"{type(self).__name__}: `hx` must be {form} of shape {list(shape)} "
                f"([B, hidden_size]); got {[list(t.shape) for t in state]}."
            )
        return state

    def _check_input(self, input: torch.Tensor) -> None:
        if input.dim() != 2 or input.shape[-1] != self.input_size:
            raise ConfigError(
                f"{type(self).__name__}: `input` has shape {tuple(input.shape)}, expected "
                f"[B, input_size] or [input_size] with input_size={self.input_size}."
            )

    def _torch_key_of(self, key: str) -> str:
        return rename_key(key, _INTERNAL_KEY, "{1}_{0}")

    def _torch_key_order(self) -> list[str]:
        return list(_TORCH_ORDER)

    def _torch_to_internal(self, local: StateDict) -> StateDict:
        return {rename_key(key, _TORCH_KEY, "{1}.{0}"): value for key, value in local.items()}

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias}"


class DPRNNCell(DPRNNCellBase):
    """Drop-in ``nn.RNNCell`` (tanh or relu) with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            elman_mode("DPRNNCell", nonlinearity), input_size, hidden_size, bias, device, dtype
        )
        self.nonlinearity = nonlinearity


class DPLSTMCell(DPRNNCellBase):
    """Drop-in ``nn.LSTMCell`` with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__("LSTM", input_size, hidden_size, bias, device, dtype)


class DPGRUCell(DPRNNCellBase):
    """Drop-in ``nn.GRUCell`` with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__("GRU", input_size, hidden_size, bias, device, dtype)


def _as_tuple(hx: CellState) -> tuple[torch.Tensor, ...]:
    return tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
