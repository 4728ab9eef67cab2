"""The explicit private step: a logical batch in physical chunks, one noisy step, its charge."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.privacy.step import Charge, private_step


@pytest.fixture(autouse=True)
def _no_noise_is_expected_here():
    with warnings.catch_warnings():   # sigma = 0: the accountant warns epsilon is infinite
        warnings.simplefilter("ignore", UserWarning)
        yield


def _private(sigma: float = 0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    data = DataLoader(TensorDataset(torch.randn(20, 4), torch.randint(2, (20,))), batch_size=10)
    result = dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  data_loader=data, noise_multiplier=sigma, max_grad_norm=0.5,
                                  accountant="rdp", seed=1, reproducible_mechanism=True)
    return result


def _forward_backward(module):
    def run(chunk):
        x, y = chunk
        if x.shape[0]:
            torch.nn.functional.cross_entropy(module(x), y).backward()
        return int(x.shape[0])
    return run


def _gradients_of_one_step(chunk_size):
    result = _private()
    batch = next(iter(result.data_loader))   # the same seeded Poisson batch every time
    assert batch[0].shape[0] > 3
    before = [p.detach().clone() for p in result.module.parameters()]
    charge = private_step(result.optimizer, batch, chunk_size, _forward_backward(result.module))
    after = [p.detach() for p in result.module.parameters()]
    return [b - a for b, a in zip(before, after)], charge, result


def test_physical_chunks_give_the_step_of_the_whole_logical_batch():
    whole, _, _ = _gradients_of_one_step(None)
    chunked, _, _ = _gradients_of_one_step(3)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_step_returns_what_it_charged_and_charges_the_accountant_once():
    _, charge, result = _gradients_of_one_step(2)
    assert charge == Charge(noise_multiplier=0.0, sample_rate=0.5,
                            batch_size=charge.batch_size, step=0, batch_index=0)
    assert result.engine.accountant.history == [(0.0, 0.5, 1)]


def test_a_failed_chunk_releases_nothing_of_its_batch():
    result = _private()
    loader = iter(result.data_loader)

    def failing(chunk):
        _forward_backward(result.module)(chunk)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        private_step(result.optimizer, next(loader), 2, failing)
    assert all(getattr(p, "summed_grad", None) is None for p in result.module.parameters())
    assert result.engine.accountant.history == []
