"""ModuleValidator: every problem reported with path, problem and fix; fix() gives a valid model."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.check import check_per_sample_gradients
from dptrain.grad_sample.module import GradSampleModule
from dptrain.layers import (
    DPGRU,
    DPLSTM,
    DPRNN,
    DPGRUCell,
    DPLSTMCell,
    DPMultiheadAttention,
    DPRNNCell,
)
from dptrain.validation import ModuleProblem, ModuleValidator


def _conv_net(norm: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, norm.num_features, 3), norm, nn.ReLU())


class _TextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.rnn = nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(12, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.embedding(tokens))
        return self.head(output[:, -1])


def test_batchnorm_is_reported_with_its_path_the_problem_and_the_fix():
    (problem,) = ModuleValidator.validate(_conv_net(nn.BatchNorm2d(8)))
    assert problem.path == "1"
    assert "BatchNorm2d" in problem.problem and "running statistics" in problem.problem
    assert "GroupNorm" in problem.fix


def test_frozen_batchnorm_is_still_reported():
    model = _conv_net(nn.BatchNorm2d(8))
    model[1].requires_grad_(False)
    assert [p.path for p in ModuleValidator.validate(model)] == ["1"]


def test_problem_reads_as_one_line_naming_the_submodule():
    text = str(ModuleValidator.validate(_conv_net(nn.BatchNorm2d(8)))[0])
    assert "\n" not in text and text.startswith("1: ") and "Fix:" in text


def test_instancenorm_with_running_stats_is_reported_and_without_is_accepted():
    assert (
        len(ModuleValidator.validate(_conv_net(nn.InstanceNorm2d(8, track_running_stats=True))))
        == 1
    )
    assert ModuleValidator.validate(_conv_net(nn.InstanceNorm2d(8, affine=True))) == []


@pytest.mark.parametrize(
    "layer",
    [
        nn.LSTM(3, 4),
        nn.GRU(3, 4),
        nn.RNN(3, 4),
        nn.LSTMCell(3, 4),
        nn.GRUCell(3, 4),
        nn.RNNCell(3, 4),
        nn.MultiheadAttention(4, 2),
    ],
)
def test_trainable_fused_layers_are_reported_pointing_to_the_dp_layer(layer):
    (problem,) = ModuleValidator.validate(nn.Sequential(layer))
    assert problem.path == "0" and "dptrain.layers.DP" in problem.fix


def test_frozen_recurrent_layer_is_accepted():
    layer = nn.LSTM(3, 4).requires_grad_(False)
    assert ModuleValidator.is_valid(nn.Sequential(layer))


def test_dp_layers_are_accepted():
    model = nn.ModuleList([DPLSTM(3, 4), DPGRU(3, 4), DPRNN(3, 4), DPMultiheadAttention(4, 2)])
    assert ModuleValidator.validate(model) == []


def test_every_problem_is_reported_in_module_order():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Sequential(nn.GRU(4, 4), nn.SyncBatchNorm(4)))
    assert [p.path for p in ModuleValidator.validate(model)] == ["0", "1.0", "1.1"]


def test_raise_if_invalid_raises_unsupported_module_error_naming_path_and_fix():
    with pytest.raises(UnsupportedModuleError, match=r"'1': BatchNorm2d.*ModuleValidator.fix"):
        ModuleValidator.raise_if_invalid(_conv_net(nn.BatchNorm2d(8)))


@pytest.mark.parametrize(("channels", "groups"), [(64, 32), (48, 16), (6, 2), (7, 1)])
def test_fix_replaces_batchnorm_by_groupnorm_with_gcd_32_groups(channels, groups):
    fixed = ModuleValidator.fix(_conv_net(nn.BatchNorm2d(channels)))
    assert isinstance(fixed[1], nn.GroupNorm)
    assert (fixed[1].num_groups, fixed[1].num_channels) == (groups, channels)


def test_fix_carries_batchnorm_affine_parameters_and_eps_over():
    model = _conv_net(nn.BatchNorm2d(8, eps=1e-3))
    nn.init.normal_(model[1].weight), nn.init.normal_(model[1].bias)
    norm = ModuleValidator.fix(model)[1]
    torch.testing.assert_close(norm.weight, model[1].weight)
    torch.testing.assert_close(norm.bias, model[1].bias)
    assert norm.eps == 1e-3


def test_fix_returns_a_copy_and_leaves_the_model_alone_by_default():
    model = _conv_net(nn.BatchNorm2d(8))
    fixed = ModuleValidator.fix(model)
    assert fixed is not model and isinstance(model[1], nn.BatchNorm2d)


def test_fix_in_place_replaces_the_submodules_of_the_given_model():
    model = _conv_net(nn.BatchNorm2d(8))
    assert ModuleValidator.fix(model, inplace=True) is model
    assert isinstance(model[1], nn.GroupNorm)


def test_fix_turns_off_instancenorm_running_stats_and_keeps_its_class_and_affine_weights():
    model = _conv_net(nn.InstanceNorm2d(8, affine=True, track_running_stats=True))
    nn.init.normal_(model[1].weight)
    norm = ModuleValidator.fix(model)[1]
    assert type(norm) is nn.InstanceNorm2d and not norm.track_running_stats
    torch.testing.assert_close(norm.weight, model[1].weight)


def test_fixed_recurrent_model_computes_the_same_outputs():
    model = _TextModel().double()
    fixed = ModuleValidator.fix(model)
    assert isinstance(fixed.rnn, DPLSTM) and ModuleValidator.is_valid(fixed)
    tokens = torch.randint(0, 10, (3, 7))
    torch.testing.assert_close(fixed(tokens), model(tokens), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("layer", "dp_type"),
    [(nn.GRU(3, 4, bias=False), DPGRU), (nn.RNN(3, 4, nonlinearity="relu"), DPRNN)],
)
def test_fix_swaps_each_recurrent_kind_for_its_dp_layer_with_the_same_weights(layer, dp_type):
    fixed = ModuleValidator.fix(nn.Sequential(layer))[0]
    assert type(fixed) is dp_type
    for name, value in layer.state_dict().items():
        torch.testing.assert_close(fixed.state_dict()[name], value)


@pytest.mark.parametrize(
    ("cell", "dp_type"),
    [
        (nn.LSTMCell(3, 4), DPLSTMCell),
        (nn.GRUCell(3, 4), DPGRUCell),
        (nn.RNNCell(3, 4, nonlinearity="relu"), DPRNNCell),
    ],
)
def test_fix_swaps_each_cell_for_its_dp_cell_computing_the_same_step(cell, dp_type):
    fixed = ModuleValidator.fix(cell)
    assert type(fixed) is dp_type
    x = torch.randn(2, 3)
    expected, actual = cell(x), fixed(x)
    for e, a in zip(
        expected if isinstance(expected, tuple) else (expected,),
        actual if isinstance(actual, tuple) else (actual,),
    ):
        torch.testing.assert_close(a, e)


def test_fixed_transformer_encoder_computes_the_same_outputs():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    fixed = ModuleValidator.fix(encoder)
    assert all(isinstance(block.self_attn, DPMultiheadAttention) for block in fixed.layers)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    padding = torch.tensor([[False] * 4 + [True]] * 3)
    torch.testing.assert_close(
        fixed(x, src_key_padding_mask=padding), encoder(x, src_key_padding_mask=padding)
    )


def test_fix_keeps_the_training_mode_and_frozen_parameters():
    attention = nn.MultiheadAttention(4, 2, add_bias_kv=True).eval()
    attention.out_proj.requires_grad_(False)
    fixed = ModuleValidator.fix(nn.Sequential(attention))[0]
    assert not fixed.training
    assert not fixed.out_proj.weight.requires_grad and fixed.q_proj.weight.requires_grad
    assert fixed.bias_k.requires_grad


def test_fix_keeps_device_and_dtype():
    fixed = ModuleValidator.fix(nn.Sequential(nn.LSTM(3, 4).double(), nn.BatchNorm1d(4).double()))
    assert all(p.dtype == torch.float64 for p in fixed.parameters())


def test_fix_replaces_an_offending_root_module():
    assert isinstance(ModuleValidator.fix(nn.GRU(3, 4)), DPGRU)


def test_fix_keeps_a_shared_module_shared():
    shared = nn.BatchNorm1d(4)
    fixed = ModuleValidator.fix(nn.Sequential(shared, nn.ReLU(), shared))
    assert fixed[0] is fixed[2] and isinstance(fixed[0], nn.GroupNorm)


def test_fixed_resnet18_validates_and_runs():
    model = torchvision.models.resnet18(num_classes=3)
    assert len(ModuleValidator.validate(model)) == 20
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.is_valid(fixed)
    assert fixed(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_fix_refuses_a_lazy_batchnorm_before_its_first_forward():
    with pytest.raises(UnsupportedModuleError, match="LazyBatchNorm1d.*forward"):
        ModuleValidator.fix(nn.Sequential(nn.LazyBatchNorm1d()))


def test_module_problem_exposes_path_problem_and_fix():
    problem = ModuleProblem("a.b", "it mixes samples.", "remove it.")
    assert (problem.path, problem.problem, problem.fix) == (
        "a.b",
        "it mixes samples.",
        "remove it.",
    )


def test_fixed_recurrent_model_gets_exact_per_sample_gradients():
    fixed = ModuleValidator.fix(_TextModel().double())
    tokens, targets = torch.randint(0, 10, (4, 6)), torch.randint(0, 2, (4,))
    errors = check_per_sample_gradients(fixed, tokens, targets, nn.CrossEntropyLoss())
    assert len(errors) == len(list(fixed.parameters()))
    assert max(errors.values()) < 1e-10


def test_grad_sample_module_refuses_an_unfixed_model_and_points_to_fix():
    with pytest.raises(UnsupportedModuleError, match=r"'rnn'.*ModuleValidator.fix"):
        GradSampleModule(_TextModel())



class _RunningMean(nn.Module):
    """Centres its input with a mean buffer that each training batch updates in place or replaces
    (`update`: a leak), or that stays fixed (`update=None`)."""

    def __init__(self, width: int = 3, update: str | None = "in_place") -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2)
        self.update = update
        self.register_buffer("running_mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.update == "in_place":
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        elif self.training and self.update == "replace":
            self.running_mean = 0.9 * self.running_mean + 0.1 * x.detach().mean(0)
        return self.fc(x - self.running_mean)


@pytest.mark.parametrize("update", ["in_place", "replace"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_buffer_updated_by_a_training_forward_is_refused_naming_it(mode: str,
                                                                     update: str) -> None:
    from dptrain.grad_sample.ghost import GhostClippingModule

    wrapper = GradSampleModule if mode == "hooks" else GhostClippingModule
    private = wrapper(nn.Sequential(_RunningMean(update=update)).double())
    with pytest.raises(UnsupportedModuleError, match=r"'0\.running_mean'"):
        private(torch.randn(4, 3, dtype=torch.float64))


def test_fixed_buffers_and_eval_mode_forwards_are_accepted() -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    GradSampleModule(nn.Sequential(_RunningMean(update=None)).double())(x).sum().backward()
    GradSampleModule(nn.Sequential(_RunningMean()).double()).eval()(x)


def test_problem_of_reports_the_module_itself_and_not_its_submodules():
    net = _conv_net(nn.BatchNorm2d(8))
    assert ModuleValidator.problem_of(net) is None
    problem = ModuleValidator.problem_of(net[1], "1")
    assert problem == ModuleValidator.validate(net)[0]


def test_replacement_of_converts_one_refused_module_and_returns_an_accepted_one_unchanged():
    bn = nn.BatchNorm2d(8)
    assert isinstance(ModuleValidator.replacement_of(bn), nn.GroupNorm)
    net = _conv_net(nn.BatchNorm2d(8))
    assert ModuleValidator.replacement_of(net) is net
    assert isinstance(ModuleValidator.replacement_of(net)[1], nn.BatchNorm2d)
