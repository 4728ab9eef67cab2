"""Whole models: every trainable parameter's per-sample gradient matches recomputation."""

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import dptrain
from dptrain.errors import UnsupportedModuleError
from dptrain.layers import DPLSTM
from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class LSTMTextClassifier(nn.Module):
    """Embedding -> 2-layer bidirectional DPLSTM over packed padded sequences -> Linear."""

    def __init__(self, vocab: int = 13, dim: int = 4, hidden: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.lstm = DPLSTM(dim, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        lengths = (idx != 0).sum(1)
        packed = pack_padded_sequence(self.emb(idx), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


class TinyTransformer(nn.Module):
    """Embedding -> 2 TransformerEncoderLayers (key padding mask) -> mean pool -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(idx), src_key_padding_mask=idx == 0).mean(1))


def test_small_cnn_per_sample_gradients_are_exact() -> None:
    model = SmallCNN().double()
    x, y = torch.randn(3, 3, 8, 8, dtype=F64), torch.tensor([0, 3, 1])
    assert_per_sample_exact(model, x, y, nn.CrossEntropyLoss())


def test_lstm_text_classifier_on_padded_sequences_is_exact() -> None:
    model = LSTMTextClassifier().double()
    idx = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 0, 0], [11, 0, 0, 0, 0]])
    assert_per_sample_exact(model, idx, torch.tensor([0, 1, 1, 0]), nn.CrossEntropyLoss())


def test_small_transformer_encoder_after_validator_fix_is_exact() -> None:
    model = dptrain.ModuleValidator.fix(TinyTransformer()).double()
    idx = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    assert_per_sample_exact(model, idx, torch.tensor([0, 2, 1]), nn.CrossEntropyLoss())


def test_resnet18_after_validator_fix_is_exact() -> None:
    model = dptrain.ModuleValidator.fix(torchvision.models.resnet18(num_classes=5)).double()
    x, y = torch.randn(3, 3, 32, 32, dtype=F64), torch.tensor([0, 4, 2])
    assert_per_sample_exact(model, x, y, nn.CrossEntropyLoss())


def test_resnet18_with_batchnorm_is_refused_until_fixed() -> None:
    with pytest.raises(UnsupportedModuleError, match=r"'bn1'.*ModuleValidator\.fix"):
        dptrain.GradSampleModule(torchvision.models.resnet18(num_classes=5))
