"""Ghost norms of groups of rows (a user's examples, dptrain.grad_sample.ghost_groups) on the Hugging
Face zoo, float64: each group's squared norm of its mean gradient, and its summed gradient, against
micro-batch recomputation (each example alone, its own loss)."""

import pytest
import torch

from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.ghost_groups import GroupedGhost, group_layout
from tests.grad_sample.hf_zoo import gemma_norms_in_float64, make_case

GROUPS = torch.tensor([0, 0, 1])  # the zoo's 3 rows: a user with two examples, one with one
FACTORS = torch.tensor([0.5, 1.0], dtype=torch.float64)  # the mean's 1 / n_u
CASES = ["bert", "gpt2_lm", "llama_lm", "gemma2_lm", "gemma3_sdpa_lm", "vit", "nanogpt"]


def _captured(name: str, strategy: str) -> tuple[GhostClippingModule, dict[str, torch.Tensor]]:
    case = make_case(name)
    truth = microbatch_grad_samples(case.model, case.inputs, case.targets, case.loss_fn)
    ghost = GhostClippingModule(case.model, strategy=strategy)
    case.loss_fn(ghost(*case.inputs), case.targets).backward()
    return ghost, truth


@pytest.mark.parametrize("strategy", ["auto", "ghost"])
@pytest.mark.parametrize("name", CASES)
def test_group_norms_equal_the_norms_of_micro_batch_group_means(name, strategy) -> None:
    with gemma_norms_in_float64():
        ghost, truth = _captured(name, strategy)
        norms = GroupedGhost(ghost, GROUPS, 2).squared_norms(FACTORS)
    for param_name, p in ghost.trainable_parameters():
        g = truth[param_name]
        means = torch.stack([g[:2].mean(0), g[2]]).flatten(1)
        tolerance = 1e-12 if name in ("gemma3_sdpa_lm", "bert", "gpt2_lm", "vit", "nanogpt") else 1e-6
        torch.testing.assert_close(norms[p], means.square().sum(1), rtol=tolerance, atol=1e-14,
                                   msg=param_name)


@pytest.mark.parametrize("name", ["gpt2_lm", "gemma3_sdpa_lm"])
def test_group_gradients_equal_the_micro_batch_sums_of_their_rows(name) -> None:
    with gemma_norms_in_float64():
        ghost, truth = _captured(name, "ghost")
        sums = GroupedGhost(ghost, GROUPS, 2).group_gradients([1, 0])
    for param_name, p in ghost.trainable_parameters():
        g = truth[param_name]
        torch.testing.assert_close(sums[p], torch.stack([g[2], g[:2].sum(0)]), rtol=1e-10, atol=1e-13,
                                   msg=param_name)


def test_the_layout_repeats_a_short_groups_first_row_marked_absent() -> None:
    rows, present = group_layout(torch.tensor([0, 0, 0, 1, 2, 2]), 3)
    assert rows.tolist() == [[0, 3, 4], [1, 3, 5], [2, 3, 4]]
    assert present.tolist() == [[True, True, True], [True, False, True], [True, False, False]]
