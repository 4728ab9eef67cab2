"""Model definitions: the Opacus paper's four benchmark models, digits_mlp, resnet18, a small GPT.

Build any of them by name with :func:`get_model` (``MODELS`` lists the names); :func:`input_spec`
says what their inputs look like (for synthetic data in tests and benchmarks).
"""

from dptrain.models.cnn import Cifar10CNN, MnistCNN
from dptrain.models.mlp import DigitsMLP
from dptrain.models.registry import MODELS, InputSpec, get_model, input_spec
from dptrain.models.resnet import resnet18
from dptrain.models.text import ImdbEmbedding, ImdbLSTM
from dptrain.models.transformer import Transformer

__all__ = [
    "MODELS",
    "Cifar10CNN",
    "DigitsMLP",
    "ImdbEmbedding",
    "ImdbLSTM",
    "InputSpec",
    "MnistCNN",
    "Transformer",
    "get_model",
    "input_spec",
    "resnet18",
]
