"""The outer-product algebra of ghost clipping against explicit per-sample gradients."""

import pytest
import torch
from torch import nn

from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.grad_sample.ghost_math import (
    BLOCK_GRAM_MIN_POSITIONS,
    CHUNK_FIRST_MIN_WIDTH,
    GRAM_CHUNK,
    bias_grads,
    chunked_gram,
    chunked_gram_roundings,
    ghost_sq_norms,
    gram,
    gram_bounds,
    gram_dtype,
    instantiated_sq_norms,
    prefer_ghost,
    roundoff,
    weighted_bias_sum,
    weighted_outer_sum,
)
from dptrain.grad_sample.ghost_linear import linear_clipped_sum, linear_norms
from tests.grad_sample.test_ghost_support import F64, TOL, sum_loss
from tests.op_tally import OpTally


def _explicit(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients G_i^T A_i by einsum, [B, p, d]."""
    return torch.einsum("btp,btd->bpd", g, a)


@pytest.mark.parametrize("positions", [1, 5])
def test_ghost_norms_equal_norms_of_explicit_per_sample_gradients(positions) -> None:
    a, g = torch.randn(4, positions, 3, dtype=F64), torch.randn(4, positions, 6, dtype=F64)
    expected = _explicit(a, g).square().sum(dim=(1, 2))
    torch.testing.assert_close(ghost_sq_norms(a, g), expected, rtol=TOL, atol=TOL)


def test_instantiated_norms_equal_norms_of_explicit_per_sample_gradients() -> None:
    a, g = torch.randn(4, 5, 3, dtype=F64), torch.randn(4, 5, 6, dtype=F64)
    expected = _explicit(a, g).square().sum(dim=(1, 2))
    torch.testing.assert_close(instantiated_sq_norms(a, g), expected, rtol=TOL, atol=TOL)


def test_weighted_outer_sum_equals_weighted_sum_of_explicit_gradients() -> None:
    a, g, w = torch.randn(4, 5, 3, dtype=F64), torch.randn(4, 5, 6, dtype=F64), torch.rand(4, dtype=F64)
    expected = torch.einsum("b,bpd->pd", w, _explicit(a, g))
    torch.testing.assert_close(weighted_outer_sum(a, g, w), expected, rtol=TOL, atol=TOL)


def test_weighted_bias_sum_equals_weighted_sum_of_bias_gradients() -> None:
    g, w = torch.randn(4, 5, 6, dtype=F64), torch.rand(4, dtype=F64)
    expected = (w[:, None] * bias_grads(g)).sum(dim=0)
    torch.testing.assert_close(weighted_bias_sum(g, w), expected, rtol=TOL, atol=TOL)


def test_weighted_bias_sum_of_an_empty_batch_is_zero() -> None:
    g, w = torch.randn(0, 5, 6, dtype=F64), torch.rand(0, dtype=F64)
    assert torch.equal(weighted_bias_sum(g, w), torch.zeros(6, dtype=F64))


def bmm_output_elements(func, args, kwargs, out) -> int:
    """The output elements of a batched matrix product (0 for other operations)."""
    return out.numel() if func.overloadpacket is torch.ops.aten.bmm else 0


def float64_grams(func, args, kwargs, out) -> int:
    """1 for a float64 batched matrix product with more than one output column (a Gram)."""
    return int(func.overloadpacket is torch.ops.aten.bmm and out.dtype == torch.float64 and out.shape[-1] > 1)


def test_a_gram_of_many_positions_multiplies_three_of_its_four_half_blocks() -> None:
    t = torch.randn(3, 2 * BLOCK_GRAM_MIN_POSITIONS, 5)
    with OpTally(bmm_output_elements) as products:
        gram(t)
    assert products.total == 3 * 3 * BLOCK_GRAM_MIN_POSITIONS**2


@pytest.mark.parametrize("positions", [BLOCK_GRAM_MIN_POSITIONS, BLOCK_GRAM_MIN_POSITIONS + 1])
def test_a_gram_of_many_positions_is_the_product_with_the_transpose(positions) -> None:
    t = torch.randn(3, positions, 7, dtype=F64)
    result = gram(t)
    torch.testing.assert_close(result, t @ t.transpose(1, 2), rtol=TOL, atol=TOL)


def test_float32_ghost_norms_over_many_positions_are_upper_bounds_within_the_gram_tolerance() -> None:
    a, g = torch.randn(4, 2 * BLOCK_GRAM_MIN_POSITIONS, 24), torch.randn(4, 2 * BLOCK_GRAM_MIN_POSITIONS, 40)
    exact = _explicit(a.double(), g.double()).square().sum(dim=(1, 2))
    ratio = ghost_sq_norms(a, g).double() / exact
    assert bool((ratio >= 1).all()) and ratio.max().item() <= 1 + 2**-10


def test_float32_grams_of_unaligned_positions_need_no_float64_recomputation() -> None:
    # independent positions: |K[t, s]| << ||a_t|| ||a_s|| off the diagonal, so the entries' round-off
    # weighs about gamma times the squared norm, not gamma T times it (above the tolerance here)
    generator = torch.Generator().manual_seed(0)
    a, g = (torch.randn(4, 128, 256, generator=generator) for _ in range(2))
    with OpTally(float64_grams) as float64:
        norms = ghost_sq_norms(a, g)
    assert float64.total == 0
    assert bool((norms.double() >= _explicit(a.double(), g.double()).square().sum(dim=(1, 2))).all())


@pytest.mark.parametrize("width", [GRAM_CHUNK, 5 * GRAM_CHUNK + 3, 40 * GRAM_CHUNK])
def test_a_chunked_gram_is_the_product_with_the_transpose(width) -> None:
    t = torch.randn(2, 6, width, dtype=F64)
    torch.testing.assert_close(chunked_gram(t), t @ t.transpose(1, 2), rtol=TOL, atol=TOL)


def test_a_chunked_gram_rounds_each_product_a_chunk_and_two_short_sums_times() -> None:
    # 40 chunks: groups of ceil(sqrt(40)) = 7, 6 groups
    assert chunked_gram_roundings(40 * GRAM_CHUNK) == GRAM_CHUNK + 6 + 5
    assert chunked_gram_roundings(GRAM_CHUNK) == GRAM_CHUNK


def test_float32_chunked_gram_entries_err_within_their_rounding_bound() -> None:
    generator = torch.Generator().manual_seed(3)
    t = torch.randn(2, 8, 4000, generator=generator) + 3  # aligned rows: large, same-sign products
    exact = t.double() @ t.double().transpose(1, 2)
    rows = t.double().norm(dim=2)
    allowed = roundoff(chunked_gram_roundings(4000), torch.float32) * rows.unsqueeze(2) * rows.unsqueeze(1)
    assert bool(((chunked_gram(t).double() - exact).abs() <= allowed).all())


def aligned_inputs_and_token_gradients(width_a: int, width_g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformer layer under a loss on every token: inputs ``[4, 128, width_a]`` sharing one
    large direction (as normalised hidden states do) and independent output gradients."""
    generator = torch.Generator().manual_seed(4)
    common = torch.randn(1, 1, width_a, generator=generator)
    a = 4 * common + torch.randn(4, 128, width_a, generator=generator)
    return a, torch.randn(4, 128, width_g, generator=generator)


def test_a_transformer_layer_under_a_token_level_loss_needs_no_float64_grams() -> None:
    # its float32 Grams' plain slack is about gamma_p T of the norm (above the tolerance); the
    # chunked Grams' about gamma_70 T: no sample is recomputed in float64
    a, g = aligned_inputs_and_token_gradients(96, 1024)
    with OpTally(float64_grams) as float64:
        norms = ghost_sq_norms(a, g)
    assert float64.total == 0
    assert bool((norms.double() >= _explicit(a.double(), g.double()).square().sum(dim=(1, 2))).all())


def test_a_vocabulary_wide_gram_is_chunked_at_once() -> None:
    # an LM head's output gradient: no float32 product over all V features, no float64 Gram
    a, g = aligned_inputs_and_token_gradients(32, CHUNK_FIRST_MIN_WIDTH + 1)

    def wide_products(func, args, kwargs, out) -> int:  # Gram products (not [T, T] @ [T, 1])
        gram_product = func.overloadpacket is torch.ops.aten.bmm and out.shape[-1] > 1
        return int(gram_product and (out.dtype == F64 or args[0].shape[2] > GRAM_CHUNK))

    with OpTally(wide_products) as wide:
        ghost_sq_norms(a, g)
    assert wide.total == 0


def cancelling_pairs(width: int, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, 2, width]`` float32 inputs (second = first + a tiny offset) and output gradients (second
    = minus first): ``G^T A = g_1 (a_1 - a_2)^T`` is tiny next to ``M^2``. Also its exact squared norms."""
    generator = torch.Generator().manual_seed(5)
    first = 100 * torch.randn(batch, 1, width, generator=generator)
    a = torch.cat([first, first + 1e-2 * torch.randn(batch, 1, width, generator=generator)], dim=1)
    half = torch.randn(batch, 1, width, generator=generator)
    g = torch.cat([half, -half], dim=1)
    exact = half[:, 0].double().square().sum(dim=1) * (a[:, 0].double() - a[:, 1].double()).square().sum(dim=1)
    return a, g, exact


def test_chunked_float32_gram_bounds_of_cancelling_samples_are_upper_bounds() -> None:
    # the bound alone (no float64 recomputation): the computed identity undershoots, the slack covers it
    a, g, exact = cancelling_pairs(20 * GRAM_CHUNK)
    gamma = roundoff(chunked_gram_roundings(a.shape[2]), torch.float32)
    gram_a, gram_g = chunked_gram(a), chunked_gram(g)
    identity = torch.linalg.vecdot(gram_a.double().flatten(1), gram_g.double().flatten(1))
    bound, _ = gram_bounds(gram_a, gram_g, gamma, gamma)
    assert bool((identity < exact).any())  # adversarial: the float32 identity undershoots
    assert bool((bound >= exact).all())


def test_ghost_norms_of_cancelling_samples_wider_than_a_chunk_are_upper_bounds() -> None:
    a, g, exact = cancelling_pairs(5 * GRAM_CHUNK + 3)
    assert bool((ghost_sq_norms(a, g).double() >= exact).all())


def test_bf16_inputs_give_float32_norms() -> None:
    a, g = torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 3, 5).bfloat16()
    assert ghost_sq_norms(a, g).dtype == torch.float32


def test_cost_model_prefers_ghost_for_few_positions_and_wide_layers() -> None:
    assert prefer_ghost(positions=16, in_features=512, out_features=512)


def test_cost_model_prefers_instantiation_for_many_positions_and_narrow_layers() -> None:
    assert not prefer_ghost(positions=1024, in_features=27, out_features=32)


@pytest.mark.parametrize("shape", [(5, 3), (5, 4, 3), (5, 2, 4, 3)], ids=["vectors", "sequence", "two_middle_dims"])
def test_linear_norm_sampler_matches_microbatch_recomputation(shape) -> None:
    layer = nn.Linear(3, 2).double()
    x = torch.randn(shape, dtype=F64)
    target = torch.randn(*shape[:-1], 2, dtype=F64)
    truth = microbatch_grad_samples(layer, x, target, sum_loss)
    norms = linear_norms(layer, [x], target)  # d(sum_loss)/d(output) = target
    for name, p in layer.named_parameters():
        expected = truth[name].reshape(shape[0], -1).square().sum(dim=1)
        torch.testing.assert_close(norms[p], expected, rtol=TOL, atol=TOL)


def test_linear_clipped_sum_matches_microbatch_recomputation() -> None:
    layer = nn.Linear(3, 2).double()
    x, target, w = torch.randn(5, 4, 3, dtype=F64), torch.randn(5, 4, 2, dtype=F64), torch.rand(5, dtype=F64)
    truth = microbatch_grad_samples(layer, x, target, sum_loss)
    sums = linear_clipped_sum(layer, [x], target, {p: w for p in layer.parameters()})
    for name, p in layer.named_parameters():
        torch.testing.assert_close(sums[p], torch.tensordot(w, truth[name], dims=1), rtol=TOL, atol=TOL)


def test_grams_of_float32_inputs_run_in_float32_where_float32_products_are_ieee() -> None:
    assert gram_dtype(torch.zeros(2, 3)) == torch.float32
    assert gram_dtype(torch.zeros(2, 3, dtype=torch.bfloat16)) == torch.float32
    assert gram_dtype(torch.zeros(2, 3, dtype=F64)) == F64


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_grams_run_in_float64_where_float32_products_are_reduced_precision(precision) -> None:
    # their round-off would exceed the float32 bound the norms rely on
    backend = torch.backends.mkldnn.matmul
    previous, backend.fp32_precision = backend.fp32_precision, precision
    try:
        assert gram_dtype(torch.zeros(2, 3)) == F64
        a, g = torch.randn(4, 5, 3), torch.randn(4, 5, 6)
        expected = _explicit(a.double(), g.double()).square().sum(dim=(1, 2))
        torch.testing.assert_close(ghost_sq_norms(a, g).double(), expected, rtol=1e-6, atol=0)
    finally:
        backend.fp32_precision = previous


def test_ghost_cost_ratio_depends_on_the_device_and_on_float64_grams() -> None:
    from dptrain.grad_sample.ghost_math import FLOAT64_GRAM_COST, GHOST_COST_RATIOS, ghost_cost_ratio

    assert ghost_cost_ratio(torch.zeros(2, 3)) == GHOST_COST_RATIOS["cpu"]
    assert ghost_cost_ratio(torch.zeros(2, 3, device="meta")) == GHOST_COST_RATIOS["cuda"]  # not the CPU's
    backend = torch.backends.mkldnn.matmul
    previous, backend.fp32_precision = backend.fp32_precision, "bf16"
    try:  # float32 Grams would not be IEEE: float64 Grams, which cost more
        assert ghost_cost_ratio(torch.zeros(2, 3)) == GHOST_COST_RATIOS["cpu"] * FLOAT64_GRAM_COST["cpu"]
        assert ghost_cost_ratio(torch.zeros(2, 3, dtype=F64)) == GHOST_COST_RATIOS["cpu"]  # float64 anyway
    finally:
        backend.fp32_precision = previous
