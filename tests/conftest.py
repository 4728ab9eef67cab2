"""Shared test settings: small thread counts (CI has 2 cores) and deterministic seeds."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
