"""Native rules of the Hugging Face layers (Conv1D, RMS norms, ViTEmbeddings) against recomputation."""

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.hf_layers import SCALE_NORMS, SCALED_EMBEDDINGS
from dptrain.grad_sample.module import GradSampleModule
from dptrain.grad_sample.registry import get_grad_sampler, get_norm_sampler
from dptrain.grad_sample.check import check_per_sample_gradients
from tests.grad_sample.conftest import assert_per_sample_exact, sum_of_outputs
from tests.grad_sample.test_ghost_support import REGIMES, assert_ghost_matches_hooks

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

F64 = torch.float64


def _existing(qualified: str) -> type | None:
    """The class named ``package.module.Class`` in the installed transformers, or None."""
    module, _, name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


class Conv1DStack(nn.Module):
    """GPT-2's MLP: Conv1D(4 -> 6), tanh, Conv1D(6 -> 3), on ``[B, T, 4]``."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(6, 4), Conv1D(3, 6)
        nn.init.normal_(self.c_fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.tanh(self.c_fc(x)))


def test_conv1d_has_a_grad_sampler_and_a_norm_sampler() -> None:
    layer = Conv1D(3, 4)
    assert get_grad_sampler(layer) is not None and get_norm_sampler(layer) is not None


def test_conv1d_per_sample_gradients_are_exact(random_targets) -> None:
    model = Conv1DStack().double()
    x = torch.randn(4, 5, 4, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


@pytest.mark.parametrize("regime", REGIMES)
def test_conv1d_ghost_clipped_sums_equal_hooks_mode(regime) -> None:
    ghost = assert_ghost_matches_hooks(Conv1DStack().double(), (torch.randn(4, 5, 4, dtype=F64),), regime, strategy="ghost")
    assert ghost.layer_strategies() == {"c_fc": "ghost", "c_proj": "ghost"}


def test_conv1d_used_twice_in_one_pass_is_merged_for_ghost_clipping() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = Conv1D(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.tanh(self.c(x)))

    ghost = assert_ghost_matches_hooks(Twice().double(), (torch.randn(3, 5, 4, dtype=F64),), "mixed", strategy="ghost")
    assert ghost.layer_strategies() == {"c": "ghost"}


# These multiply by (1 + w) in float32 whatever the input dtype: autograd's own gradient (the
# reference) then carries float32 rounding, which the sampler (in the input's dtype) does not.
FLOAT32_INSIDE = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


@pytest.mark.parametrize("name", SCALE_NORMS, ids=lambda n: n.rpartition(".")[2])
def test_every_listed_rms_norm_has_exact_per_sample_gradients(name, random_targets) -> None:
    cls = _existing(name)
    if cls is None:
        pytest.skip(f"{name} is not in this transformers version")
    layer = cls(6).double()
    nn.init.normal_(layer.weight)
    x = torch.randn(3, 4, 6, dtype=F64)
    assert get_grad_sampler(layer) is not None
    if cls.__name__ in FLOAT32_INSIDE:
        errors = check_per_sample_gradients(layer, x, random_targets(layer, x), sum_of_outputs)
        assert errors["weight"] < 1e-5
    else:
        assert_per_sample_exact(layer, x, random_targets(layer, x))


def test_the_listed_rms_norms_exist_in_the_installed_transformers() -> None:
    missing = [name for name in SCALE_NORMS if _existing(name) is None]
    assert len(missing) <= len(SCALE_NORMS) // 2, f"most listed RMS norms are gone: {missing}"


def _vit_embeddings(**overrides) -> nn.Module:
    from transformers.models.vit.modeling_vit import ViTConfig, ViTEmbeddings

    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=6, **overrides)
    return ViTEmbeddings(config, use_mask_token=True).double()


class MaskedViTEmbeddings(nn.Module):
    """ViTEmbeddings with a per-sample mask of its 4 patches (the mask token's use)."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = _vit_embeddings()
        nn.init.normal_(self.embeddings.mask_token)

    def forward(self, pixels: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return self.embeddings(pixels, bool_masked_pos=masked.bool())


def test_vit_embeddings_per_sample_gradients_are_exact(random_targets) -> None:
    model = MaskedViTEmbeddings()
    inputs = (torch.randn(3, 3, 8, 8, dtype=F64), torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]))
    assert get_grad_sampler(model.embeddings) is not None
    assert_per_sample_exact(model, inputs, random_targets(model, *inputs))


def test_vit_embeddings_with_dropout_are_refused_naming_the_config_key() -> None:
    gsm = GradSampleModule(_vit_embeddings(hidden_dropout_prob=0.1))
    with pytest.raises(UnsupportedModuleError, match="hidden_dropout_prob=0.0"):
        gsm(torch.randn(2, 3, 8, 8, dtype=F64)).sum().backward()


def test_hf_layer_ghost_rules_apply_inside_ghost_mode_without_fallback(monkeypatch) -> None:
    # the torch.func fallback would be called for a layer without a native rule
    import dptrain.grad_sample.module as module

    def no_fallback(*args, **kwargs):
        raise AssertionError("torch.func fallback used")

    monkeypatch.setattr(module, "functorch_grad_samples", no_fallback)
    model = nn.Sequential(Conv1D(4, 4), _existing(SCALE_NORMS[0])(4)).double()
    ghost = GhostClippingModule(model, loss_reduction="sum")
    ghost(torch.randn(3, 5, 4, dtype=F64)).sum().backward()
    assert ghost.squared_norms()


def test_the_engine_imports_neither_transformers_nor_peft_for_a_plain_model() -> None:
    code = (
        "import sys, torch\n"
        "import dptrain\n"
        "from dptrain.grad_sample.ghost import GhostClippingModule\n"
        "from dptrain.grad_sample.coverage import layer_rules\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 2))\n"
        "g = GhostClippingModule(m); g(torch.randn(4, 3)).sum().backward(); layer_rules(m)\n"
        "dptrain.PrivacyEngine()\n"
        "print(sorted(k for k in ('transformers', 'peft') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class ScaledLookup(nn.Module):
    """A scaled word embedding of transformers (``embedding(ids) * embed_scale``) under a tanh."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.embed = cls(11, 4, 0, embed_scale=2.5).double()  # padding id 0, as the checkpoints
        nn.init.normal_(self.embed.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed(ids))


def _scaled_embedding(name: str) -> type:
    cls = _existing(name)
    if cls is None:
        pytest.skip(f"{name} is not in this transformers version")
    return cls


@pytest.mark.parametrize("name", SCALED_EMBEDDINGS, ids=lambda n: n.rpartition(".")[2])
def test_every_listed_scaled_embedding_has_exact_per_sample_gradients(name, random_targets) -> None:
    model = ScaledLookup(_scaled_embedding(name))
    ids = torch.tensor([[1, 3, 3, 0], [2, 2, 2, 2], [5, 0, 9, 1]])
    assert_per_sample_exact(model, ids, random_targets(model, ids))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", SCALED_EMBEDDINGS[:2], ids=lambda n: n.rpartition(".")[2])
def test_scaled_embedding_ghost_norms_and_clipped_sums_equal_hooks_mode(name, regime) -> None:
    model = ScaledLookup(_scaled_embedding(name))
    ids = torch.tensor([[1, 3, 3, 0], [2, 2, 2, 2], [5, 0, 9, 1]])
    ghost = assert_ghost_matches_hooks(model, (ids,), regime, strategy="ghost")
    assert ghost.layer_strategies() == {"embed": "ghost"}


def test_the_listed_scaled_embeddings_exist_and_multiply_by_embed_scale() -> None:
    present = [cls for cls in map(_existing, SCALED_EMBEDDINGS) if cls is not None]
    assert len(present) > len(SCALED_EMBEDDINGS) // 2
    for cls in present:
        layer = cls(5, 3, 0, embed_scale=2.0).double()
        ids = torch.tensor([[1, 4]])
        torch.testing.assert_close(layer(ids), 2.0 * nn.functional.embedding(ids, layer.weight, 0))
