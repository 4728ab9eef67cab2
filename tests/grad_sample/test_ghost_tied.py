"""Ghost clipping of an input embedding tied to the LM head: cross terms without ``[B, V, D]``."""

import pytest
import torch
from torch import nn

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.ghost_embedding import embedding_linear_cross_term
from dptrain.grad_sample.ghost_registry import get_cross_term
from tests.grad_sample.test_ghost_support import F64, REGIMES, assert_ghost_matches_hooks
from tests.op_tally import OpTally

VOCAB, DIM = 11, 4


class TiedLM(nn.Module):
    """Embedding (padding_idx 0) -> Linear -> tanh -> head tied to the embedding: ``[B, T]`` -> ``[B, T, V]``.

    ``reuse_embedding`` embeds the tokens a second time (an Embedding has no use merger, so ghost
    mode instantiates it, and its tied head must follow).
    """

    def __init__(self, reuse_embedding: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.reuse_embedding = reuse_embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if self.reuse_embedding:
            x = x + self.emb(tokens.flip(1))
        return self.head(torch.tanh(self.mix(x)))


def _tokens() -> torch.Tensor:
    tokens = torch.randint(1, VOCAB, (5, 6))
    tokens[1, 4:] = 0  # padding
    tokens[2, :] = 3  # one token repeated
    return tokens


@pytest.mark.parametrize("strategy", ["auto", "ghost"])
@pytest.mark.parametrize("regime", REGIMES)
def test_tied_embedding_and_head_equal_hooks_mode_on_the_ghost_path(regime, strategy) -> None:
    ghost = assert_ghost_matches_hooks(TiedLM().double(), (_tokens(),), regime, strategy=strategy)
    assert ghost.layer_strategies()["emb"] == ghost.layer_strategies()["head"] == "ghost"


def test_tied_embedding_and_head_keep_no_per_sample_gradient() -> None:
    model = TiedLM().double()
    ghost = GhostClippingModule(model, loss_reduction="sum")
    ghost(_tokens()).sum().backward()
    ghost.squared_norms()
    assert all(all(p is not model.emb.weight for p in grads) for grads in ghost._instantiated.values())


def test_a_tied_layer_instantiated_in_a_pass_takes_its_partner_along() -> None:
    ghost = assert_ghost_matches_hooks(TiedLM(reuse_embedding=True).double(), (_tokens(),), "mixed", strategy="ghost")
    assert ghost.layer_strategies()["emb"] == ghost.layer_strategies()["head"] == "instantiate"


def test_the_cross_term_rule_is_found_in_either_order() -> None:
    emb, head = nn.Embedding(3, 2), nn.Linear(2, 3)
    assert get_cross_term(emb, head) is not None and get_cross_term(head, emb) is not None


def test_tied_layers_without_a_cross_term_rule_are_instantiated_and_equal_hooks_mode() -> None:
    class TiedLinears(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    ghost = assert_ghost_matches_hooks(TiedLinears().double(), (torch.randn(4, 2, 3, dtype=F64),), "mixed")
    assert ghost.layer_strategies() == {"a": "instantiate", "b": "instantiate"}



def test_the_cross_term_casts_no_vocabulary_wide_gradient_to_float64() -> None:
    # the cross term reads one head-gradient entry per (position, token): the [B, S, V] float32 head
    # gradient is gathered first, not copied to float64 whole
    model = TiedLM()
    tokens = _tokens()
    embedding_use = ([tokens], torch.randn(*tokens.shape, DIM))
    head_use = ([torch.randn(*tokens.shape, DIM)], torch.randn(*tokens.shape, VOCAB))

    def vocabulary_wide_float64(func, args, kwargs, out) -> int:
        return int(isinstance(out, torch.Tensor) and out.dtype == F64 and out.numel() >= tokens.numel() * VOCAB)

    with OpTally(vocabulary_wide_float64) as copies:
        bound = embedding_linear_cross_term(model.emb, embedding_use, model.head, head_use)[model.emb.weight]
    assert copies.total == 0
    assert bound.shape == (tokens.shape[0],)
