"""Under ghost clipping the DP layers give the same per-sample norms and clipped sums as hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.layers import DPLSTM, DPMultiheadAttention

DT = torch.float64
BATCH = 5


class _RecurrentAttentionClassifier(nn.Module):
    """DPLSTM -> DPMultiheadAttention (with bias_k/bias_v) -> Linear, batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = DPLSTM(3, 6, batch_first=True, bidirectional=True)
        self.attention = DPMultiheadAttention(12, 2, batch_first=True, add_bias_kv=True)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(x)
        attended, _ = self.attention(hidden, hidden, hidden)
        return self.head(attended.mean(dim=1))


def _norms_and_sums(wrapper: GradSampleModule, model: nn.Module) -> tuple[dict, dict]:
    """Per-sample squared norms and a fixed weighting's sums, by parameter name."""
    x = torch.randn(BATCH, 7, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 1, 0, 1])
    nn.functional.cross_entropy(wrapper(x), y).backward()
    norms = wrapper.squared_norms()
    weights = {p: torch.linspace(0.1, 1.0, BATCH, dtype=DT) for p in norms}
    sums = wrapper.weighted_sum(weights)
    names = {p: name for name, p in model.named_parameters()}
    wrapper.clear_per_sample()
    wrapper.remove_hooks()
    return {names[p]: v for p, v in norms.items()}, {names[p]: v for p, v in sums.items()}


@pytest.mark.parametrize("strategy", ["ghost", "auto"])
def test_ghost_clipping_matches_hooks_on_dp_layers(strategy):
    model = _RecurrentAttentionClassifier().double()
    expected_norms, expected_sums = _norms_and_sums(GradSampleModule(model), model)
    model.zero_grad()
    norms, sums = _norms_and_sums(GhostClippingModule(model, strategy=strategy), model)
    assert set(norms) == set(expected_norms) == {name for name, _ in model.named_parameters()}
    for name in expected_norms:
        torch.testing.assert_close(norms[name], expected_norms[name], msg=name)
        torch.testing.assert_close(sums[name], expected_sums[name], msg=name)
