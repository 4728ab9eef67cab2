"""Independent noise: C = I, today's DP-SGD (the default strategy).

Its generator returns the draw untouched (no buffer, no copy), so a run with it adds exactly the
noise DP-SGD always added, bit for bit, from the same generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from torch import Tensor

from dptrain.privacy.noise.base import NoiseGenerator


class IndependentGenerator(NoiseGenerator):
    """The identity: the noise of step t is Z_t."""

    def __call__(self, key: int, draw: Tensor) -> Tensor:
        return draw


@dataclass(frozen=True)
class Independent:
    """Independent Gaussian noise at every step (C = I, first column (1, 0, 0, ...))."""

    name = "independent"
    #: the ledger's `algorithm` and `noise`
    algorithm = "DP-SGD"
    noise_words = "gaussian"

    @staticmethod
    def preferred_groups(sample_rate: float, bands: int | None = None) -> int:
        """The cyclic groups a plan without a selection gets: 1 (Poisson sampling)."""
        return 1

    def toeplitz_column(self, num_steps: int) -> np.ndarray:
        """(1, 0, ..., 0), float64, shape (num_steps,)."""
        column = np.zeros(num_steps)
        column[0] = 1.0
        return column

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Independent:
        return cls()

    @property
    def extra_copies(self) -> int:
        return 0

    def generator(self) -> IndependentGenerator:
        return IndependentGenerator()
