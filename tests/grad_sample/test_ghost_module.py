"""GhostClippingModule: whole models vs the hooks mode, and the module's own behaviour."""

import copy
import logging

import pytest
import torch
from torch import nn

from dptrain.errors import ConfigError, UnsupportedModuleError
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.layers import DPLSTM, DPMultiheadAttention
from tests.grad_sample.test_ghost_support import (
    F64,
    REGIMES,
    TOL,
    assert_ghost_matches_hooks,
    clipped_sums,
    per_sample_sq_norms,
    run,
)


class SmallCNN(nn.Module):
    """Conv -> in-place ReLU -> GroupNorm -> conv -> pool -> linear: ``[B, 1, 8, 8]`` -> ``[B, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(inplace=True), nn.GroupNorm(2, 4),
            nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        )
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class LSTMClassifier(nn.Module):
    """Embedding -> DPLSTM -> last state -> linear: ``[B, T]`` token ids -> ``[B, 2]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 4, padding_idx=0)
        self.lstm = DPLSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.fc(out[:, -1])


class TransformerEncoder(nn.Module):
    """Token + position embeddings, one post-LN encoder block, mean pool: ``[B, T]`` -> ``[B, 2]``."""

    def __init__(self, vocab: int = 13, width: int = 8, steps: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(steps, width)
        self.attn = DPMultiheadAttention(width, 2, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, width))
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.tok(tokens) + self.pos(positions)
        x = self.ln1(x + self.attn(x, x, x, need_weights=False)[0])
        x = self.ln2(x + self.mlp(x))
        return self.head(x.mean(dim=1))


MODELS = {
    "cnn": (SmallCNN, lambda: (torch.randn(6, 1, 8, 8, dtype=F64),)),
    "lstm_classifier": (LSTMClassifier, lambda: (torch.randint(0, 11, (6, 7)),)),
    "transformer_encoder": (TransformerEncoder, lambda: (torch.randint(0, 13, (6, 6)),)),
}


def _cross_entropy_case(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    make, inputs = MODELS[name]
    model, x = make().double(), inputs()
    with torch.no_grad():
        classes = model(*x).shape[-1]
    return model, x, torch.randint(0, classes, (x[0].shape[0],))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("name", MODELS)
def test_whole_model_clipped_sums_equal_hooks_mode(name, regime) -> None:
    model, x, y = _cross_entropy_case(name)
    assert_ghost_matches_hooks(model, x, regime, target=y, loss_fn=nn.functional.cross_entropy, reduction="mean")


def test_layer_strategies_name_every_hooked_layer_with_its_choice() -> None:
    model, x, y = _cross_entropy_case("cnn")
    ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    assert ghost.layer_strategies() == {
        "features.0": "instantiate",  # 64 positions x (9 -> 4): instantiating is cheaper
        "features.2": "instantiate",  # GroupNorm: per-sample grads are [B, C]
        "features.3": "instantiate",
        "fc": "ghost",
    }


def test_strategy_choice_is_logged_once_per_layer_at_debug_level(caplog) -> None:
    model, x, y = _cross_entropy_case("cnn")
    ghost = GhostClippingModule(model)
    with caplog.at_level(logging.DEBUG, logger="dptrain.grad_sample.ghost"):
        for _ in range(2):
            nn.functional.cross_entropy(ghost(*x), y).backward()
    named = [r for r in caplog.records if "'fc'" in r.getMessage()]
    assert len(named) == 1 and named[0].levelno == logging.DEBUG


def test_the_layers_choices_are_summed_up_in_one_info_line_per_change(caplog) -> None:
    """A run's log gets one line, not one per layer (a transformer has dozens)."""
    model, x, y = _cross_entropy_case("cnn")
    ghost = GhostClippingModule(model)
    with caplog.at_level(logging.INFO, logger="dptrain.grad_sample.ghost"):
        for _ in range(2):
            nn.functional.cross_entropy(ghost(*x), y).backward()
            ghost.squared_norms()
            ghost.clear_per_sample()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "ghost clipping: 1 layers by their ghost norms, 3 with per-sample gradients (the DEBUG log "
        "level names each layer's choice)"]


def test_backward_computes_no_plain_parameter_gradient() -> None:
    model, x, y = _cross_entropy_case("transformer_encoder")
    ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    assert all(p.grad is None for p in ghost.parameters())
    assert all(p.requires_grad for p in ghost.parameters())


def test_two_passes_concatenate_samples_like_hooks_mode() -> None:
    model, x, y = _cross_entropy_case("transformer_encoder")
    wrappers = [GradSampleModule(copy.deepcopy(model)), GhostClippingModule(copy.deepcopy(model))]
    results = []
    for wrapper in wrappers:
        for half in (slice(0, 2), slice(2, 6)):
            nn.functional.cross_entropy(wrapper(x[0][half]), y[half]).backward()
        results.append((per_sample_sq_norms(wrapper), clipped_sums(wrapper, bound=0.1)))
    (hook_norms, hook_sums), (ghost_norms, ghost_sums) = results
    assert ghost_norms.shape == (6,)
    torch.testing.assert_close(ghost_norms, hook_norms, rtol=TOL, atol=TOL)
    for name in hook_sums:
        torch.testing.assert_close(ghost_sums[name], hook_sums[name], rtol=TOL, atol=TOL)


class SharedLayers(nn.Module):
    """A Linear and a Conv1d each used twice in one forward, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).transpose(1, 2)
        x = self.conv(torch.tanh(self.conv(x))).transpose(1, 2)
        x = self.lin(torch.tanh(self.lin(x)))
        return self.head(x)


@pytest.mark.parametrize("regime", REGIMES)
def test_layers_used_twice_and_tied_weights_equal_hooks_mode(regime) -> None:
    ghost = assert_ghost_matches_hooks(SharedLayers().double(), (torch.randint(0, 9, (5, 6)),), regime, strategy="ghost")
    assert ghost.layer_strategies() == {"emb": "ghost", "conv": "instantiate", "lin": "ghost", "head": "ghost"}


class ConvAtTwoScales(nn.Module):
    """One Conv2d applied to a 1x1 summary and then to the 12x12 input: backward meets the
    many-position use (instantiation is cheaper) before the single-position one (ghost is)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summary = self.conv(nn.functional.adaptive_avg_pool2d(x, 1)).flatten(1)
        return summary + self.conv(x).mean(dim=(2, 3))


@pytest.mark.parametrize("regime", REGIMES)
def test_uses_of_one_layer_whose_shapes_favour_different_strategies_are_clipped_together(regime) -> None:
    # the norm of the summed uses has cross terms: both uses must be instantiated and added
    ghost = assert_ghost_matches_hooks(ConvAtTwoScales().double(), (torch.randn(4, 2, 12, 12, dtype=F64),), regime)
    assert ghost.layer_strategies() == {"conv": "instantiate"}


@pytest.mark.parametrize("name", MODELS)
def test_an_empty_batch_captures_no_sample(name) -> None:
    model, x, _ = _cross_entropy_case(name)
    ghost = GhostClippingModule(model)
    ghost(*(t[:0] for t in x)).sum().backward()
    assert ghost.per_sample_batch_size() == 0
    assert all(n.shape == (0,) for n in ghost.squared_norms().values())
    sums = ghost.weighted_sum({p: torch.ones(0, dtype=F64) for p in ghost.parameters()})
    assert all(not s.any() for s in sums.values())


def test_bf16_autocast_norms_are_float32_and_close_to_float32_hooks() -> None:
    model, x, y = _cross_entropy_case("transformer_encoder")
    model = model.float()
    hooks = run(GradSampleModule, model, x, y, nn.functional.cross_entropy, "mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    norms = per_sample_sq_norms(ghost)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, per_sample_sq_norms(hooks), rtol=0.1, atol=1e-3)


def test_eval_mode_captures_nothing() -> None:
    model, x, _ = _cross_entropy_case("cnn")
    ghost = GhostClippingModule(model).eval()
    ghost(*x).sum().backward()
    assert ghost.per_sample_batch_size() == 0


def test_clear_per_sample_frees_everything() -> None:
    model, x, y = _cross_entropy_case("cnn")
    ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    ghost.clear_per_sample()
    assert ghost.per_sample_batch_size() == 0
    assert all(n.shape == (0,) for n in ghost.squared_norms().values())


def test_unknown_strategy_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="strategy='fast'"):
        GhostClippingModule(nn.Linear(2, 2), strategy="fast")


def test_weights_of_the_wrong_length_are_a_config_error() -> None:
    model, x, y = _cross_entropy_case("cnn")
    ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    with pytest.raises(ConfigError, match="one weight per captured sample"):
        ghost.weighted_sum({p: torch.ones(2, dtype=F64) for p in ghost.parameters()})


class ParameterOutsideItsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.fc.weight


def test_check_complete_rejects_a_parameter_used_outside_its_module() -> None:
    ghost = GhostClippingModule(ParameterOutsideItsModule())
    ghost(torch.randn(4, 3)).sum().backward()
    with pytest.raises(UnsupportedModuleError, match="fc.weight"):
        ghost.check_complete()


def test_check_complete_accepts_a_gradient_left_from_the_previous_step() -> None:
    model, x, y = _cross_entropy_case("cnn")
    ghost = GhostClippingModule(model)
    for p in ghost.parameters():
        p.grad = torch.ones_like(p)  # written by the optimizer, never zeroed by the user's loop
    nn.functional.cross_entropy(ghost(*x), y).backward()
    ghost.check_complete()


def test_recurrent_cell_is_re_decided_on_its_merged_time_steps() -> None:
    model, x, y = _cross_entropy_case("lstm_classifier")
    ghost = run(GhostClippingModule, model, x, y, nn.functional.cross_entropy, "mean")
    # 7 uses of T = 1 each look ghost-cheap; merged (T = 7, d = 5, p = 20) instantiation wins
    assert ghost.layer_strategies()["lstm.hh_l0"] == "instantiate"


def _two_linear_ghost_step() -> tuple[GhostClippingModule, list]:
    """A ghost Linear -> Linear after one backward, and a weak reference to the storage of the
    second layer's input (an intermediate activation: only the ghost module keeps it)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    seen = []
    model[2].register_forward_hook(lambda layer, args, out: seen.append(StorageWeakRef(args[0].untyped_storage())))
    ghost = GhostClippingModule(model, loss_reduction="sum", strategy="ghost")
    ghost(torch.randn(3, 5, 4, dtype=F64)).sum().backward()
    return ghost, seen


def test_weighted_sum_frees_the_stored_inputs_of_each_ghost_layer() -> None:
    ghost, stored = _two_linear_ghost_step()
    ghost.squared_norms()
    assert not stored[0].expired()
    ghost.weighted_sum({p: torch.ones(3, dtype=F64) for p in ghost.parameters()})
    assert stored[0].expired()


def test_a_second_weighted_sum_of_one_backward_is_a_config_error_naming_the_layer() -> None:
    ghost, _ = _two_linear_ghost_step()
    weights = {p: torch.ones(3, dtype=F64) for p in ghost.parameters()}
    ghost.weighted_sum(weights)
    with pytest.raises(ConfigError, match="layer '.*2'.*weighted_sum\\(\\) once per backward"):
        ghost.weighted_sum(weights)


@pytest.mark.parametrize("wrapper", [GradSampleModule, GhostClippingModule])
def test_a_torch_function_mode_sees_only_the_models_own_operations(wrapper) -> None:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(5, 4)
    with Count() as plain:
        model(x)
    wrapped = wrapper(copy.deepcopy(model))
    with Count() as hooked:
        wrapped(x)
    # the hooks' reads of shapes and flags and their detached copies are bookkeeping, not model
    # computation: the pass's provenance mode (and a user's mode) sees the model's operations only
    # (a model without buffers: the check that a training forward changes none reads them)
    assert hooked.calls == plain.calls
