"""Seeded private steps reproduce a saved expectation bit for bit (float64).

The expectation (tests/privacy/data/step_expectation.json) was written by the code before the
per-step overhead cuts of issue 40 item 12. A speed change must not change one bit of a
per-sample gradient, a clipped sum or a noisy update: every case here runs three seeded steps
(`reproducible_mechanism`: sampling and noise from the seed) on a small conv + linear model in
float64 and compares, exactly, the per-sample gradients of the first step (SHA-256 of their bytes)
and the parameters after each step (float.hex). The cases cover hooks and ghost, flat, per-layer
and adaptive clipping, a batch with a non-finite example (left out of the clipped sum), a
sequence-first model and an embedding + LSTM model.

Regenerate only for a change that is meant to alter results, and say so in its commit:
``PYTHONPATH=$PWD python tests/privacy/test_step_expectation.py``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.layers import DPLSTM

EXPECTATION = Path(__file__).parent / "data" / "step_expectation.json"
N, BATCH, STEPS = 48, 12, 3
CASES = {
    "hooks-flat": {"grad_sample_mode": "hooks", "clipping": "flat"},
    "ghost-flat": {"grad_sample_mode": "ghost", "clipping": "flat"},
    "hooks-per_layer": {"grad_sample_mode": "hooks", "clipping": "per_layer"},
    "ghost-per_layer": {"grad_sample_mode": "ghost", "clipping": "per_layer"},
    "hooks-adaptive": {"grad_sample_mode": "hooks", "clipping": "adaptive"},
    "hooks-flat-nonfinite": {"grad_sample_mode": "hooks", "clipping": "flat", "nonfinite": True},
    "ghost-flat-nonfinite": {"grad_sample_mode": "ghost", "clipping": "flat", "nonfinite": True},
    # added with the second round of cuts (issue 40 item 12), saved from the code before it:
    # adaptive clipping's norms from the totals clip() forms, per-layer factors with a
    # non-finite example (several weight tensors to drop it from), a sequence-first model (the
    # batch moved to dim 0) and an embedding + LSTM (hundreds of tracked torch calls and
    # merged uses of the LSTM's linear pieces; ghost entries released after their sums)
    "ghost-adaptive": {"grad_sample_mode": "ghost", "clipping": "adaptive"},
    "hooks-per_layer-nonfinite": {"grad_sample_mode": "hooks", "clipping": "per_layer", "nonfinite": True},
    "ghost-per_layer-nonfinite": {"grad_sample_mode": "ghost", "clipping": "per_layer", "nonfinite": True},
    "hooks-flat-seqfirst": {"grad_sample_mode": "hooks", "clipping": "flat", "model": "seqfirst"},
    "ghost-flat-seqfirst": {"grad_sample_mode": "ghost", "clipping": "flat", "model": "seqfirst"},
    "hooks-flat-lstm": {"grad_sample_mode": "hooks", "clipping": "flat", "model": "lstm"},
    "ghost-flat-lstm": {"grad_sample_mode": "ghost", "clipping": "flat", "model": "lstm"},
}


class _EmbeddingLSTM(nn.Module):
    """Token ids [B, T] -> Embedding -> DPLSTM -> mean over time -> Linear: logits [B, 3]."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.lstm = DPLSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.emb(x))
        return self.fc(states.mean(dim=1))


class _SequenceFirst(nn.Module):
    """[T, B, F] (batch at dim 1) -> Linear per position -> mean over T: logits [B, 3]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).mean(dim=0)


VOCAB, TOKENS = 11, 5


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "lstm":
        return _EmbeddingLSTM().double()
    if kind == "seqfirst":
        return _SequenceFirst().double()
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 3)).double()


def _data(nonfinite: bool, kind: str) -> TensorDataset:
    """Inputs of `kind`'s model with 3-class labels; the seqfirst model's rows are [T=4, F=6],
    transposed to [T, B, F] per batch by `_inputs`."""
    gen = torch.Generator().manual_seed(1)
    if kind == "lstm":
        x = torch.randint(0, VOCAB, (N, TOKENS), generator=gen)
    elif kind == "seqfirst":
        x = torch.randn(N, 4, 6, generator=gen, dtype=torch.float64)
    else:
        x = torch.randn(N, 2, 6, 6, generator=gen, dtype=torch.float64)
    if nonfinite:
        x[::5, 0, 0, 0] = float("inf")  # these examples' gradients are not finite
    return TensorDataset(x, torch.randint(0, 3, (N,), generator=gen))


def _inputs(x: torch.Tensor, kind: str) -> torch.Tensor:
    return x.transpose(0, 1) if kind == "seqfirst" else x


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _run(grad_sample_mode: str, clipping: str, nonfinite: bool = False, model: str = "cnn") -> dict[str, Any]:
    """Three seeded private steps: {"grad_samples": [sha256 of each p.grad_sample at step 1]
    (hooks mode), "params": [[float.hex of each parameter's values] after each step]}."""
    kind, model = model, _model(model)
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=7, reproducible_mechanism=True)
    extra = {"target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.2,
             "count_noise_std": 1.0} if clipping == "adaptive" else {}
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(_data(nonfinite, kind), batch_size=BATCH), noise_multiplier=0.7,
        max_grad_norm=0.5, grad_sample_mode=grad_sample_mode, clipping=clipping,
        batch_first=kind != "seqfirst", **extra)
    out: dict[str, Any] = {"grad_samples": [], "params": []}
    batches = iter(loader)
    for step in range(STEPS):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(_inputs(x, kind)), y).backward()
        if step == 0 and grad_sample_mode == "hooks":
            out["grad_samples"] = [_digest(p.grad_sample) for p in model.parameters()]
        optimizer.step()
        out["params"].append([[v.hex() for v in p.detach().flatten().tolist()]
                              for p in model.parameters()])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_private_steps_are_bit_identical_to_the_saved_expectation(case: str) -> None:
    expected = json.loads(EXPECTATION.read_text())[case]
    got = _run(**CASES[case])
    assert got["grad_samples"] == expected["grad_samples"], "per-sample gradients changed"
    for step, (g, e) in enumerate(zip(got["params"], expected["params"], strict=True)):
        assert g == e, f"parameters after step {step + 1} changed"


if __name__ == "__main__":
    EXPECTATION.parent.mkdir(exist_ok=True)
    EXPECTATION.write_text(json.dumps({case: _run(**args) for case, args in CASES.items()}) + "\n")
