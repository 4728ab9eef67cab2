"""DPRNN, DPLSTM, DPGRU: recurrent layers built from ``nn.Linear`` pieces.

Drop-in replacements for ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (same constructor arguments,
forward signature, outputs and ``state_dict`` keys) whose parameters all live in
:class:`~dptrain.layers.linear.RNNLinear` submodules, so the per-sample gradient engine computes
their per-sample gradients with the ``Linear`` rule:

- the input-to-hidden projection ``ih_l{k}`` runs once on the whole sequence ``[B, T, D]``;
- the hidden-to-hidden projection ``hh_l{k}`` (and ``hr_l{k}`` for an LSTM with ``proj_size``)
  runs once per time step on ``[B, 1, H]`` (``[1, B, H]`` when ``batch_first=False``), so its
  per-sample gradient is the engine's sum over the T uses.

Every Linear input keeps the batch at the position the layer's ``batch_first`` says: wrap the
model with ``GradSampleModule(model, batch_first=<the layer's batch_first>)``.

Variable-length batches (PackedSequence) stop each sample's recurrence at its own length: after
it, the state is carried unchanged, so padding never reaches the outputs, the final states or the
gradients.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from dptrain.errors import ConfigError
from dptrain.layers._arguments import check_rnn_args, elman_mode, refuse_projection
from dptrain.layers._state_dict import StateDict, TorchStateDictMixin, rename_key
from dptrain.layers.linear import RNNLinear
from dptrain.layers.rnn_cells import CELLS, State
from dptrain.layers.sequences import PaddedBatch, like_input, reverse_each, step_mask, to_padded

RNNInput = torch.Tensor | PackedSequence
HiddenState = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

_INTERNAL_KEY = re.compile(r"^(ih|hh|hr)_(l\d+(?:_reverse)?)\.(weight|bias)$")
_TORCH_KEY = re.compile(r"^(weight|bias)_(ih|hh|hr)_(l\d+(?:_reverse)?)$")


class DPRNNBase(TorchStateDictMixin):
    """Shared implementation of the DP recurrent layers (see the module docstring).

    Args are those of ``torch.nn.RNNBase``; ``mode`` is one of ``RNN_TANH``, ``RNN_RELU``,
    ``LSTM``, ``GRU``. Submodules: ``ih_l{k}[_reverse]``, ``hh_l{k}[_reverse]`` and, with
    ``proj_size > 0``, ``hr_l{k}[_reverse]``; ``state_dict`` keys are torch's
    (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``, ...).
    """

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_rnn_args(type(self).__name__, input_size, hidden_size, num_layers, dropout, proj_size)
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        self._cell = CELLS[mode]
        self._torch_names: list[str] = []
        for layer in range(num_layers):
            for direction in range(self.num_directions):
                self._add_direction(layer, direction, device, dtype)
        self.reset_parameters()
        self._install_torch_naming()

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def output_size(self) -> int:
        """Size of h (the per-direction output features): proj_size if set, else hidden_size."""
        return self.proj_size or self.hidden_size

    def _add_direction(
        self,
        layer: int,
        direction: int,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """Create ih/hh(/hr) Linear modules of one layer and direction."""
        suffix = _suffix(layer, direction)
        in_features = self.input_size if layer == 0 else self.output_size * self.num_directions
        gates = self._cell.num_gates * self.hidden_size
        kwargs = {"device": device, "dtype": dtype}
        self.add_module(f"ih_{suffix}", RNNLinear(in_features, gates, bias=self.bias, **kwargs))
        self.add_module(
            f"hh_{suffix}", RNNLinear(self.output_size, gates, bias=self.bias, **kwargs)
        )
        names = [f"weight_ih_{suffix}", f"weight_hh_{suffix}"]
        if self.bias:
            names += [f"bias_ih_{suffix}", f"bias_hh_{suffix}"]
        if self.proj_size > 0:
            self.add_module(
                f"hr_{suffix}", RNNLinear(self.hidden_size, self.proj_size, bias=False, **kwargs)
            )
            names.append(f"weight_hr_{suffix}")
        self._torch_names += names

    def reset_parameters(self) -> None:
        """Torch's initialisation: every parameter ~ U(-1/sqrt(H), 1/sqrt(H)), H = hidden_size."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def flatten_parameters(self) -> None:
        """No-op, for drop-in compatibility with torch's cuDNN RNNs."""

    # ---- forward -------------------------------------------------------------------------

    def forward(
        self, input: RNNInput, hx: HiddenState | None = None
    ) -> tuple[RNNInput, HiddenState]:
        """Run the recurrence, exactly as the torch layer does.

        Args:
            input: ``[B, T, input_size]`` (batch_first) or ``[T, B, input_size]``, ``[T,
                input_size]`` unbatched, or a PackedSequence (sorted or not).
            hx: initial state ``h0`` of shape ``[num_layers * num_directions, B, output_size]``
                (an LSTM takes ``(h0, c0)``, c0 with ``hidden_size``); zeros when None.

        Returns:
            ``(output, h_n)`` (``(output, (h_n, c_n))`` for an LSTM): output has
            ``num_directions * output_size`` features and the input's form; ``h_n``/``c_n`` hold
            the state after each sample's last valid step, layers and directions stacked as in
            torch.
        """
        unbatched = isinstance(input, torch.Tensor) and input.dim() == 2
        if unbatched:
            input = input.unsqueeze(0 if self.batch_first else 1)
            hx = _map_state(hx, lambda t: t.unsqueeze(1))
        if isinstance(input, torch.Tensor):
            self._check_input(input)
        batch = to_padded(input, self.batch_first)
        self._check_input(batch.data)
        initial = self._initial_states(batch, hx)
        output, finals = self._run_layers(batch, initial)
        h_n = torch.stack([state[0] for state in finals])
        result: HiddenState = h_n
        if self._cell.has_cell_state:
            result = (h_n, torch.stack([state[1] for state in finals]))
        if unbatched:
            return output.squeeze(0 if self.batch_first else 1), _map_state(
                result, lambda t: t.squeeze(1)
            )
        return like_input(output, batch), result

    def _run_layers(
        self, batch: PaddedBatch, initial: list[State]
    ) -> tuple[torch.Tensor, list[State]]:
        """All layers and directions; returns the padded output and the final state of each."""
        mask = None if batch.is_full_length else step_mask(batch)
        x = batch.data
        finals: list[State] = []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.num_directions):
                index = layer * self.num_directions + direction
                reverse = direction == 1
                sequence = reverse_each(x, batch) if reverse else x
                out, final = self._run_direction(
                    sequence, initial[index], _suffix(layer, direction), batch, mask
                )
                outputs.append(reverse_each(out, batch) if reverse else out)
                finals.append(final)
            x = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, p=self.dropout, training=True)
        return x, finals

    def _run_direction(
        self,
        sequence: torch.Tensor,
        state: State,
        suffix: str,
        batch: PaddedBatch,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, State]:
        """One direction of one layer over time.

        Args:
            sequence: ``[B, T, D]`` or ``[T, B, D]`` (the layer layout), already reversed for a
                backward direction.
            state: initial state tensors, each ``[B, *]``.
            mask: ``[T, B, 1]`` bool of valid steps, or None when all samples have length T.

        Returns:
            ``(h for every step in the layout, final state)``.
        """
        time_dim = batch.time_dim
        gates_x = getattr(self, f"ih_{suffix}")(sequence)  # one Linear call on the whole sequence
        hidden_to_hidden = getattr(self, f"hh_{suffix}")
        projection = getattr(self, f"hr_{suffix}", None)
        steps = []
        # unbind (not select per step): its backward stacks the T gradients once, where T
        # selects would each materialise a zero tensor of the whole sequence.
        for t, gates_x_t in enumerate(gates_x.unbind(time_dim)):
            gates_h = self._per_step(hidden_to_hidden, state[0])
            new_state = self._cell.step(gates_x_t, gates_h, state)
            if projection is not None:
                new_state = (self._per_step(projection, new_state[0]),) + new_state[1:]
            if mask is not None:
                new_state = tuple(
                    torch.where(mask[t], new, old) for new, old in zip(new_state, state)
                )
            state = new_state
            steps.append(state[0])
        return torch.stack(steps, dim=time_dim), state

    def _per_step(self, linear: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        """Apply ``linear`` to ``h`` ``[B, F]`` with a length-1 time axis in the layer layout."""
        time_dim = 1 if self.batch_first else 0
        return linear(h.unsqueeze(time_dim)).squeeze(time_dim)

    # ---- argument checks -----------------------------------------------------------------

    def _check_input(self, data: torch.Tensor) -> None:
        """ConfigError unless ``data`` is ``[B, T, input_size]`` / ``[T, B, input_size]``."""
        if data.dim() != 3 or data.shape[-1] != self.input_size:
            layout = "[B, T, input_size]" if self.batch_first else "[T, B, input_size]"
            raise ConfigError(
                f"{type(self).__name__}: `input` has shape {tuple(data.shape)}, expected {layout} "
                f"with input_size={self.input_size} (or an unbatched [T, input_size] tensor, or a "
                f"PackedSequence). Check the layer's `input_size` and `batch_first`."
            )

    def _initial_states(self, batch: PaddedBatch, hx: HiddenState | None) -> list[State]:
        """Per layer and direction, the initial state tuple (each ``[B, features]``)."""
        count = self.num_layers * self.num_directions
        size = batch.data.shape[batch.batch_dim]
        data = batch.data
        shapes = [(count, size, self.output_size)]
        if self._cell.has_cell_state:
            shapes.append((count, size, self.hidden_size))
        if hx is None:
            tensors = [data.new_zeros(shape) for shape in shapes]
        else:
            tensors = list(hx) if isinstance(hx, (tuple, list)) else [hx]
            self._check_hx(tensors, shapes)
        return [tuple(t[index] for t in tensors) for index in range(count)]

    def _check_hx(self, tensors: list[torch.Tensor], shapes: list[tuple[int, int, int]]) -> None:
        names = ["h0", "c0"][: len(shapes)]
        expected = ", ".join(f"{name} {list(shape)}" for name, shape in zip(names, shapes))
        got = ", ".join(str(list(t.shape)) for t in tensors)
        if len(tensors) != len(shapes) or any(tuple(t.shape) != s for t, s in zip(tensors, shapes)):
            form = "a tuple (h0, c0)" if len(shapes) == 2 else "one tensor h0"
            raise ConfigError(
                f"{type(self).__name__}: the initial state `hx` must be {form} of shape "
                f"[num_layers * num_directions, B, features]: expected {expected}, got {got}."
            )

    # ---- state_dict naming ---------------------------------------------------------------

    def _torch_key_of(self, key: str) -> str:
        return rename_key(key, _INTERNAL_KEY, "{2}_{0}_{1}")

    def _torch_key_order(self) -> list[str]:
        return self._torch_names

    def _torch_to_internal(self, local: StateDict) -> StateDict:
        return {rename_key(key, _TORCH_KEY, "{1}_{2}.{0}"): value for key, value in local.items()}

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        text += f", bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}"
        text += f", bidirectional={self.bidirectional}"
        return text + (f", proj_size={self.proj_size}" if self.proj_size else "")


class DPRNN(DPRNNBase):
    """Drop-in ``nn.RNN`` (Elman, tanh or relu) with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        proj_size: int = 0,
    ) -> None:
        refuse_projection("DPRNN", proj_size)
        super().__init__(
            elman_mode("DPRNN", nonlinearity),
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            0,
            device,
            dtype,
        )
        self.nonlinearity = nonlinearity


class DPLSTM(DPRNNBase):
    """Drop-in ``nn.LSTM`` (including ``proj_size``) with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            "LSTM",
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            proj_size,
            device,
            dtype,
        )


class DPGRU(DPRNNBase):
    """Drop-in ``nn.GRU`` with per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        proj_size: int = 0,
    ) -> None:
        refuse_projection("DPGRU", proj_size)
        super().__init__(
            "GRU",
            input_size,
            hidden_size,
            num_layers,
            bias,
            batch_first,
            dropout,
            bidirectional,
            0,
            device,
            dtype,
        )


def _suffix(layer: int, direction: int) -> str:
    """Torch's parameter suffix: ``l0``, ``l0_reverse``, ``l1``, ..."""
    return f"l{layer}" + ("_reverse" if direction == 1 else "")


def _map_state(
    state: HiddenState | None, fn: Callable[[torch.Tensor], torch.Tensor]
) -> HiddenState | None:
    """Apply ``fn`` to the tensor(s) of a hidden state (None passes through)."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return tuple(fn(t) for t in state)
    return fn(state)
