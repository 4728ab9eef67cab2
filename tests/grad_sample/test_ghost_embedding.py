"""Ghost rules of embeddings under pooling: the count identity, its compact storage, and
deterministic clipped sums."""

import pytest
import torch
from torch import nn

from dptrain.grad_sample.ghost_embedding import _pair_counts, embedding_clipped_sum, embedding_compact_use, embedding_norms
from tests.grad_sample.test_ghost_support import REGIMES, LargestAllocation, assert_ghost_matches_hooks


class PooledEmbedding(nn.Module):
    """Embedding (padding_idx 0) -> mean or sum over time -> Linear: ``[B, T]`` ids -> ``[B, 2]``.

    Every position of a sample gets the same output gradient (the count identity's case); a sum
    hands the embedding a broadcast view, a mean a fresh tensor.
    """

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.emb, self.fc, self.pool = nn.Embedding(7, 3, padding_idx=0), nn.Linear(3, 2), pool

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.emb(ids)
        return self.fc(embedded.mean(dim=1) if self.pool == "mean" else embedded.sum(dim=1))


REPEATS = torch.tensor([[1, 2, 1, 1, 0], [3, 3, 3, 3, 3], [0, 4, 5, 6, 2], [0, 0, 0, 0, 0]])


@pytest.mark.parametrize("pool", ["mean", "sum"])
@pytest.mark.parametrize("regime", REGIMES)
def test_pooled_embedding_norms_and_clipped_sums_equal_hooks_mode(pool, regime) -> None:
    assert_ghost_matches_hooks(PooledEmbedding(pool).double(), (REPEATS,), regime)


def test_pooled_embedding_norms_never_form_per_position_rows() -> None:
    # the count identity needs the [B, D] gradient and integer counts, never [B * T, D] rows
    batch, steps, dim = 8, 64, 4
    layer = nn.Embedding(50, dim)
    tokens = torch.randint(0, 50, (batch, steps))
    shared = torch.randn(batch, 1, dim).expand(batch, steps, dim).contiguous()
    with LargestAllocation() as mode:
        norms = embedding_norms(layer, [tokens], shared)[layer.weight]
    assert mode.largest < batch * steps * dim
    counts = torch.stack([torch.bincount(t, minlength=50) for t in tokens]).double()
    exact = counts.square().sum(dim=1) * shared[:, 0].double().square().sum(dim=1)
    torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0)
    assert bool((norms.double() >= exact).all())


def test_pooled_embedding_use_is_kept_as_one_gradient_row_per_sample() -> None:
    layer, tokens = nn.Embedding(7, 3), REPEATS
    shared = torch.randn(4, 1, 3).expand(4, 5, 3).contiguous()
    _, kept = embedding_compact_use(layer, [tokens], shared)
    assert torch.equal(kept, shared)
    assert kept.untyped_storage().nbytes() == 4 * 3 * shared.element_size()


def test_embedding_use_with_differing_position_gradients_is_kept_as_captured() -> None:
    grads = torch.randn(4, 5, 3)
    _, kept = embedding_compact_use(nn.Embedding(7, 3), [REPEATS], grads)
    assert kept is grads


@pytest.mark.parametrize("shared", [True, False], ids=["pooled", "per_position"])
def test_embedding_clipped_sum_is_bitwise_the_same_on_one_and_two_threads(shared) -> None:
    # 64 x 64 positions over 5 tokens: large enough for torch to parallelise accumulation
    layer = nn.Embedding(5, 16)
    tokens = torch.randint(0, 5, (64, 64))
    grads = torch.randn(64, 1 if shared else 64, 16).expand(64, 64, 16).contiguous()
    weights = {layer.weight: torch.rand(64)}
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 2, 2):
            torch.set_num_threads(threads)
            results.append(embedding_clipped_sum(layer, [tokens], grads, weights)[layer.weight])
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_pair_counts_are_each_owners_number_of_equal_token_pairs() -> None:
    # owners 1 and 4 hold no token (all padding); key order mixes owners and ids
    ids = torch.tensor([3, 1, 3, 3, 2, 1, 2, 0])
    owners = torch.tensor([2, 0, 0, 2, 3, 0, 3, 2])
    pairs = [int(((ids[owners == i].unsqueeze(0) == ids[owners == i].unsqueeze(1))).sum()) for i in range(5)]
    assert _pair_counts(ids, owners, num_embeddings=4, batch=5).tolist() == pairs == [5, 0, 5, 4, 0]
