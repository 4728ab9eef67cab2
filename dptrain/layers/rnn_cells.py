"""One time step of each recurrent cell, from pre-computed gate pre-activations.

A cell receives ``gates_x = W_ih x_t + b_ih`` and ``gates_h = W_hh h_{t-1} + b_hh`` (both
``[B, G * H]``, G gates of H units, in torch's gate order) and the previous state; it returns the
new state. Both projections are computed by ``nn.Linear`` modules in the layer, so the cells own
no parameters and need no per-sample gradient rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

State = tuple[torch.Tensor, ...]
CellFn = Callable[[torch.Tensor, torch.Tensor, State], State]


def rnn_tanh_cell(gates_x: torch.Tensor, gates_h: torch.Tensor, state: State) -> State:
    """Elman cell: ``h' = tanh(gates_x + gates_h)``; state ``(h,)`` with h ``[B, H]``."""
    return (torch.tanh(gates_x + gates_h),)


def rnn_relu_cell(gates_x: torch.Tensor, gates_h: torch.Tensor, state: State) -> State:
    """Elman cell with ReLU: ``h' = relu(gates_x + gates_h)``; state ``(h,)``."""
    return (torch.relu(gates_x + gates_h),)


def lstm_cell(gates_x: torch.Tensor, gates_h: torch.Tensor, state: State) -> State:
    """LSTM cell, gates in torch's order (input, forget, cell, output).

    State ``(h, c)``: c ``[B, H]``; the returned h is ``o * tanh(c')``, before any projection
    (the layer applies ``weight_hr`` when ``proj_size > 0``).
    """
    _, cell = state
    in_gate, forget_gate, candidate, out_gate = (gates_x + gates_h).chunk(4, dim=-1)
    cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(in_gate) * torch.tanh(candidate)
    return torch.sigmoid(out_gate) * torch.tanh(cell), cell


def gru_cell(gates_x: torch.Tensor, gates_h: torch.Tensor, state: State) -> State:
    """GRU cell, gates in torch's order (reset, update, new); state ``(h,)``.

    As in torch, the reset gate multiplies ``W_hn h + b_hn`` (the hidden bias included).
    """
    (hidden,) = state
    x_reset, x_update, x_new = gates_x.chunk(3, dim=-1)
    h_reset, h_update, h_new = gates_h.chunk(3, dim=-1)
    reset = torch.sigmoid(x_reset + h_reset)
    update = torch.sigmoid(x_update + h_update)
    new = torch.tanh(x_new + reset * h_new)
    return ((1 - update) * new + update * hidden,)


@dataclass(frozen=True)
class CellSpec:
    """What a recurrent mode needs: gate count, step function, and whether it has a cell state."""

    num_gates: int
    step: CellFn
    has_cell_state: bool


CELLS: dict[str, CellSpec] = {
    "RNN_TANH": CellSpec(1, rnn_tanh_cell, False),
    "RNN_RELU": CellSpec(1, rnn_relu_cell, False),
    "LSTM": CellSpec(4, lstm_cell, True),
    "GRU": CellSpec(3, gru_cell, False),
}
