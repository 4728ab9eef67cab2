"""Every registered model runs under GradSampleModule with exact per-sample gradients.

Ground truth: ``dptrain.grad_sample.check`` (micro-batch recomputation, one sample at a time).
"""

import pytest
import torch
import torch.nn.functional as F

from dptrain.grad_sample.check import check_per_sample_gradients
from dptrain.models import MODELS, get_model, input_spec
from dptrain.validation import ModuleValidator
from tests.models.small_configs import SMALL

TOLERANCE = 1e-9


def token_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every sample (and token): logits ``[B, (T,) K]``, target ``[B, (T)]``."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def worst_errors(name: str, **extra: object) -> dict[str, float]:
    kwargs = {**SMALL[name], **extra}
    model = get_model(name, **kwargs).double()
    x, y = input_spec(name, input_length=4, **kwargs).batch(2, dtype=torch.float64)
    return check_per_sample_gradients(model, x, y, token_mean_cross_entropy)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_sample_gradients_match_micro_batch_recomputation(name: str) -> None:
    errors = worst_errors(name)
    assert errors, "the model has trainable parameters"
    assert {k: v for k, v in errors.items() if not v < TOLERANCE} == {}


def test_transformer_classification_head_per_sample_gradients_are_exact() -> None:
    errors = worst_errors("transformer", head="classification", num_classes=3)
    assert {k: v for k, v in errors.items() if not v < TOLERANCE} == {}


def test_transformer_tied_head_per_sample_gradients_are_exact() -> None:
    errors = worst_errors("transformer", tie_weights=True)
    assert {k: v for k, v in errors.items() if not v < TOLERANCE} == {}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_passes_the_module_validator(name: str) -> None:
    assert ModuleValidator.validate(get_model(name, **SMALL[name])) == []
