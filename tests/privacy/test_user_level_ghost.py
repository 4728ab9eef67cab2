"""User-level DP-SGD in ghost mode (privacy_unit="user", grad_sample_mode="ghost"): each sampled
user's MEAN gradient clipped to C from ghost norms, checked against float64 micro-batch ground
truth (each example's gradient from the model run on it alone, averaged per user) and against the
hooks mode."""

from __future__ import annotations

import logging

import pytest
import torch
from privacy_helpers import clipped_sum, per_sample_grads
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain

VOCAB, WIDTH, SEQ = 13, 6, 5


class TiedLM(nn.Module):
    """Embedding, LayerNorm (instantiated), Linear, tanh and an LM head tied to the embedding."""

    def __init__(self, conv: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1) if conv else None
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.norm(self.emb(ids))))
        if self.conv is not None:
            h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def _model(conv: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return TiedLM(conv).double()


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over the batch of each example's mean cross-entropy over its SEQ tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _data(user_ids: list[int], seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(user_ids), SEQ), generator=gen)
    ids[:, 0] = 3  # a token shared by every example: pairs across a user's examples
    return ids, torch.randint(0, VOCAB, (len(user_ids), SEQ), generator=gen)


def _private(x, y, user_ids, *, mode, batch_size, sigma=0.0, C=0.3, conv=False, **kwargs):
    model = _model(conv)
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=sigma, max_grad_norm=C, privacy_unit="user",
        user_ids=torch.tensor(user_ids), grad_sample_mode=mode, **kwargs)
    return model, module, optimizer, loader


def _one_step_sum(module, optimizer, batches) -> dict:
    """The noise-free clipped sum {p: Tensor[*p.shape]} of one logical step."""
    captured = {}
    optimizer.attach_step_hook(
        lambda opt: captured.update({p: p.summed_grad.clone() for p in opt.params}))
    for x, y in batches:
        optimizer.zero_grad()
        if len(x):
            token_loss(module(x), y).backward()
        optimizer.step()
        if captured:
            return captured
    raise AssertionError("no step was taken")


def _user_mean_clipped_sum(x, y, user_ids, C, conv=False) -> dict:
    """Ground truth: each user's mean of its examples' micro-batch gradients, clipped, summed."""
    model = _model(conv)
    grads = per_sample_grads(model, token_loss, x, y)
    users = sorted(set(user_ids), key=user_ids.index)
    means = {p: torch.stack([g[[i for i, u in enumerate(user_ids) if u == user]].mean(0) for user in users])
             for p, g in grads.items()}
    return dict(zip(model.parameters(), clipped_sum(means, C).values()))


def _assert_equal_by_position(model: nn.Module, got: dict, expected: dict) -> None:
    for p, e in zip(model.parameters(), expected.values()):
        torch.testing.assert_close(got[p], e, rtol=1e-10, atol=1e-13)


USERS = [7, 7, 3, 9, 9, 9, 3, 5, 7, 7, 7, 1]


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_ghost_clipped_sum_is_the_sum_of_each_users_clipped_mean_micro_batch_gradient():
    x, y = _data(USERS)
    model, module, optimizer, loader = _private(x, y, USERS, mode="ghost", batch_size=5, C=0.3)  # q = 1
    summed = _one_step_sum(module, optimizer, loader)
    expected = _user_mean_clipped_sum(x, y, USERS, 0.3)
    _assert_equal_by_position(model, summed, expected)
    assert module.layer_strategies()["emb"] == module.layer_strategies()["head"] == "ghost"


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_a_user_cut_across_ghost_chunks_is_clipped_once_as_a_whole(chunk):
    users = [0] * 5 + [1] * 3 + [2] * 4 + [3]
    x, y = _data(users)
    model, module, optimizer, loader = _private(x, y, users, mode="ghost", batch_size=4, C=0.3)
    with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                    max_physical_batch_size=chunk) as chunks:
        summed = _one_step_sum(module, optimizer, chunks)
    _assert_equal_by_position(model, summed, _user_mean_clipped_sum(x, y, users, 0.3))


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_layer_without_a_row_grouper_is_instantiated_said_once_and_exact(caplog, monkeypatch):
    # Conv1d has ghost norms but no rule folding a user's examples into one row
    from dptrain.grad_sample import ghost_groups

    monkeypatch.setattr(ghost_groups, "_WARNED", set())
    x, y = _data(USERS)
    model, module, optimizer, loader = _private(x, y, USERS, mode="ghost", batch_size=5, conv=True)
    module.strategy = "ghost"  # the conv would take the ghost path for an example
    with caplog.at_level(logging.WARNING, logger="dptrain.grad_sample.ghost_groups"):
        summed = _one_step_sum(module, optimizer, loader)
    _assert_equal_by_position(model, summed, _user_mean_clipped_sum(x, y, USERS, 0.3, conv=True))
    said = [r for r in caplog.records if "Conv1d" in r.getMessage()]
    assert len(said) == 1 and module.layer_strategies()["conv"] == "instantiate"


def _trained(mode: str, chunk: int | None) -> list[Tensor]:
    users = [u for u in range(10) for _ in range(u % 3 + 1)]  # 10 users, 20 examples
    x, y = _data(users)
    model, module, optimizer, loader = _private(x, y, users, mode=mode, batch_size=4, sigma=0.8)
    for _ in range(2):  # epochs
        with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                        max_physical_batch_size=chunk or 10 ** 6) as chunks:
            for xb, yb in chunks:
                optimizer.zero_grad()
                if len(xb):
                    token_loss(module(xb), yb).backward()
                optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [None, 3])
def test_ghost_user_level_training_equals_hooks_user_level_training(chunk):
    for ghost, hooks in zip(_trained("ghost", chunk), _trained("hooks", chunk)):
        torch.testing.assert_close(ghost, hooks, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_model_already_wrapped_for_ghost_clipping_gets_the_ghost_user_level_clipper():
    from dptrain.grad_sample.ghost import GhostClippingModule
    from dptrain.privacy.user_level_ghost import GhostUserLevelClipper

    x, y = _data(USERS)
    model = _model()
    wrapped = GhostClippingModule(model)
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=wrapped, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=5), noise_multiplier=0.0,
        max_grad_norm=0.3, privacy_unit="user", user_ids=torch.tensor(USERS))
    assert module is wrapped and isinstance(optimizer.clipper, GhostUserLevelClipper)
    _assert_equal_by_position(model, _one_step_sum(module, optimizer, loader),
                              _user_mean_clipped_sum(x, y, USERS, 0.3))


def test_a_source_dptrain_did_not_wrap_is_refused_at_user_level_naming_it():
    from privacy_helpers import FakeSource

    from dptrain.errors import ConfigError

    x, y = _data(USERS)
    model = _model()
    with pytest.raises(ConfigError, match=r"FakeSource.*pass the plain model"):
        dptrain.PrivacyEngine().make_private(
            module=FakeSource(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=5), noise_multiplier=1.0,
            max_grad_norm=0.3, privacy_unit="user", user_ids=torch.tensor(USERS))
