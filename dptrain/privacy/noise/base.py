"""What every noise strategy provides, and the state its noise generator carries between steps.

A strategy (a frozen dataclass: `Independent`, `Banded`, `Blt`) is the lower-triangular Toeplitz
matrix C of the matrix-factorization mechanism, by its first column (`toeplitz_column`). Its
`generator()` turns the i.i.d. Gaussian draw Z_t of each step into the correlated noise
(C^{-1} Z)_t the model receives, keeping a few buffers per parameter: the generator's state.

The draw Z_t is made exactly as for independent noise (`DPOptimizer._noise`: the optimizer's
generator or, in secure mode, the OS CSPRNG), already scaled to its std; the generator is linear,
so scaling before or after correlating is the same (a constant std: the plan refuses noise and
sample-rate schedules and adaptive clipping with correlated noise).

State: the buffers are resume state, saved in the checkpoint with the DP optimizer's state
(`state_dict`, CPU tensors) and restored exactly (`load_state_dict`); they are never rebuilt from
a seed and never part of the released model. They hold past noise: a checkpoint is as private as
the noise generator states it may hold (see dptrain.randomness).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from dptrain.errors import ConfigError


@runtime_checkable
class NoiseStrategy(Protocol):
    """A noise strategy (see the module docstring)."""

    name: str

    def toeplitz_column(self, num_steps: int) -> np.ndarray:
        """c, the first column of C (float64, shape (num_steps,))."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: {"name": ..., its parameters} (the ledger's plan records it)."""

    def generator(self) -> NoiseGenerator:
        """A fresh generator of this strategy's noise (empty buffers: step 0)."""

    @property
    def extra_copies(self) -> int:
        """Buffers per parameter the generator keeps (copies of the trainable parameters)."""


class NoiseGenerator:
    """(C^{-1} Z)_t from Z_t, one parameter at a time, with per-parameter buffers.

    `__call__(key, draw)` returns the noise of the parameter `key` (an int, the parameter's place
    in the optimizer) at its next step, computed from `draw` (Tensor[*p.shape], consumed: the
    result may be `draw` itself, written in place). Subclasses keep their buffers in
    `self.buffers[key]` (a list of tensors of the draw's shape, dtype and device).
    """

    def __init__(self) -> None:
        self.buffers: dict[int, list[Tensor]] = {}
        self.steps: dict[int, int] = {}  # noise outputs made per parameter

    def __call__(self, key: int, draw: Tensor) -> Tensor:
        buffers = self._placed(key, draw)
        step = self.steps.get(key, 0)
        noise = self._next(buffers, draw, step)
        self.steps[key] = step + 1
        return noise

    def _next(self, buffers: list[Tensor], draw: Tensor, step: int) -> Tensor:
        """The noise of step `step` from `draw`, updating `buffers` in place (overridden)."""
        raise NotImplementedError

    def _placed(self, key: int, draw: Tensor) -> list[Tensor]:
        """The buffers of `key` on the draw's device and dtype (a restored checkpoint's are on
        the CPU until their first use)."""
        buffers = self.buffers.setdefault(key, [])
        for i, buffer in enumerate(buffers):
            if buffer.device != draw.device or buffer.dtype != draw.dtype:
                buffers[i] = buffer.to(device=draw.device, dtype=draw.dtype)
        return buffers

    # -- resume state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"steps": {key: n}, "buffers": {key: [CPU tensors]}}: exact copies of the buffers."""
        return {"steps": {int(k): int(v) for k, v in self.steps.items()},
                "buffers": {int(k): [b.detach().to("cpu", copy=True) for b in v]
                            for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (buffers go to the parameters' device on first use)."""
        try:
            self.steps = {int(k): int(v) for k, v in state["steps"].items()}
            self.buffers = {int(k): [torch.as_tensor(b).clone() for b in v]
                            for k, v in state["buffers"].items()}
        except (KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"the checkpoint's correlated-noise state cannot be read "
                              f"({type(error).__name__}: {error}): it was written by another "
                              "dptrain version, or by a run with another privacy.noise.") from error


def check_coefficients(values: tuple[float, ...], name: str, what: str) -> tuple[float, ...]:
    """`values` as a tuple of finite floats; ConfigError naming `name` otherwise."""
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={values!r} must be a list of numbers ({what}).") from None
    if not out or not all(np.isfinite(out)):
        raise ConfigError(f"{name}={values!r} must be a non-empty list of finite numbers ({what}).")
    return out
