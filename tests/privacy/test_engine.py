"""PrivacyEngine / make_private end to end with the real GradSampleModule and accountants."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from privacy_helpers import clipped_sum, per_sample_grads, tiny_data, tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.data.sampling import DPDataLoader
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy import DPOptimizer

N = 64


def _loader(batch_size: int = 8, n: int = N) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 2, (n,), generator=gen)),
                      batch_size=batch_size)


def _private(engine=None, model=None, **kwargs):
    model = model or tiny_model()
    engine = engine or dptrain.PrivacyEngine(accountant="rdp", seed=0)
    args = {"module": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
                "data_loader": _loader(), "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    args.update(kwargs)
    return engine, *engine.make_private(**args)


def _train_epoch(model, optimizer, loader) -> None:
    """A user's ordinary loop."""
    for x, y in loader:
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_make_private_returns_the_wrapped_model_dp_optimizer_and_poisson_loader():
    _, model, optimizer, loader = _private()
    assert isinstance(model, dptrain.GradSampleModule)
    assert isinstance(optimizer, DPOptimizer) and isinstance(loader, DPDataLoader)


def test_expected_batch_size_is_the_public_sample_rate_times_n():
    _, _, optimizer, loader = _private(data_loader=_loader(batch_size=16))
    assert optimizer.sample_rate == loader.sample_rate == pytest.approx(16 / N)
    assert optimizer.expected_batch_size == pytest.approx(16.0)


def test_an_unchanged_training_loop_steps_the_accountant_once_per_batch():
    engine, model, optimizer, loader = _private()
    _train_epoch(model, optimizer, loader)
    assert len(engine.accountant) == len(loader) == N // 8
    assert engine.accountant.history[0][:2] == (1.0, pytest.approx(8 / N))


def test_epsilon_after_training_matches_google_dp_accounting():
    import dp_accounting  # test-only dependency: the independent accountant

    engine, model, optimizer, loader = _private()
    _train_epoch(model, optimizer, loader)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / N, dp_accounting.GaussianDpEvent(1.0)), len(loader))
    reference = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(reference, rel=0.02)


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_with_sigma_zero_one_step_applies_the_mean_of_clipped_per_sample_gradients():
    model = tiny_model()
    reference = tiny_model()
    x, y = tiny_data(8)
    whole = DataLoader(TensorDataset(x, y), batch_size=8)  # q = 1: the batch is all 8 examples
    _, private, optimizer, loader = _private(model=model, noise_multiplier=0.0,
                                             max_grad_norm=0.3, data_loader=whole)
    loss = nn.CrossEntropyLoss(reduction="sum")
    expected_sum = clipped_sum(per_sample_grads(reference, loss, x, y), 0.3)
    (batch_x, batch_y), = list(loader)
    assert torch.equal(batch_x, x)
    optimizer.zero_grad()
    nn.functional.cross_entropy(private(batch_x), batch_y).backward()
    optimizer.step()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        expected = p_ref - 0.5 * expected_sum[p_ref] / 8.0
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-9)


def test_an_empty_poisson_batch_still_steps_and_is_accounted():
    engine, model, optimizer, loader = _private(data_loader=_loader(batch_size=1, n=N),
                                                sample_rate_schedule=lambda step: 1e-12)  # empty
    before = [p.detach().clone() for p in model.parameters()]
    x, _y = next(iter(loader))
    assert x.shape == (0, 3)
    optimizer.step()
    assert len(engine.accountant) == 1
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_seeded_engines_repeat_a_training_run_exactly():
    finals = []
    for _ in range(2):
        engine = dptrain.PrivacyEngine("rdp", seed=11, reproducible_mechanism=True)
        _, model, optimizer, loader = _private(engine=engine)
        _train_epoch(model, optimizer, loader)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_secure_mode_runs_differ():
    finals = []
    for _ in range(2):
        engine = dptrain.PrivacyEngine("rdp", secure_mode=True)
        _, model, optimizer, loader = _private(engine=engine)
        _train_epoch(model, optimizer, loader)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert not any(torch.equal(a, b) for a, b in zip(*finals))


def test_noise_and_sample_rate_schedules_reach_the_accountant():
    engine, model, optimizer, loader = _private(
        noise_schedule={"kind": "step", "step_size": 4, "gamma": 0.5},
        sample_rate_schedule=lambda step: 8 / N if step < 2 else 4 / N)
    _train_epoch(model, optimizer, loader)
    sigmas_and_rates = [(s, q) for s, q, k in engine.accountant.history for _ in range(k)]
    assert sigmas_and_rates == [(1.0, 8 / N)] * 2 + [(1.0, 4 / N)] * 2 + [(0.5, 4 / N)] * 4


def test_adaptive_clipping_accounts_the_configured_sigma_and_moves_the_bound():
    engine, model, optimizer, loader = _private(clipping="adaptive", max_grad_norm=100.0,
                                                count_noise_std=2.0)
    _train_epoch(model, optimizer, loader)
    assert {s for s, _, _ in engine.accountant.history} == {1.0}
    assert optimizer.max_grad_norm < 100.0


def test_per_layer_clipping_with_a_list_of_bounds_trains():
    engine, model, optimizer, loader = _private(clipping="per_layer",
                                                max_grad_norm=[0.5, 0.5, 0.5, 0.5])
    _train_epoch(model, optimizer, loader)
    assert optimizer.max_grad_norm == pytest.approx(1.0) and len(engine.accountant) == 8


def test_ghost_mode_wraps_the_model_in_the_ghost_clipping_module():
    from dptrain.grad_sample import ghost

    engine, model, optimizer, loader = _private(grad_sample_mode="ghost")
    _train_epoch(model, optimizer, loader)
    assert isinstance(model, ghost.GhostClippingModule) and len(engine.accountant) == 8


def test_state_dict_resume_repeats_the_next_batches_and_noise_exactly():
    engine, model, optimizer, loader = _private(
        engine=dptrain.PrivacyEngine("rdp", seed=4, reproducible_mechanism=True))
    _train_epoch(model, optimizer, loader)
    state = engine.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train_epoch(model, optimizer, loader)
    expected = [p.detach().clone() for p in model.parameters()]
    engine2, model2, optimizer2, loader2 = _private(
        engine=dptrain.PrivacyEngine("rdp", seed=99, reproducible_mechanism=True))
    model2.load_state_dict(weights)
    engine2.load_state_dict(state)
    _train_epoch(model2, optimizer2, loader2)
    assert len(engine2.accountant) == 16
    assert all(torch.equal(a, b) for a, b in zip(expected, model2.parameters()))


@pytest.mark.filterwarnings("ignore:gdp accountant.*approximation:UserWarning")
def test_make_private_with_epsilon_calibrates_sigma_to_the_target():
    engine = dptrain.PrivacyEngine(accountant="gdp", seed=0)
    model = tiny_model()
    _, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_loader(), max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-3, epochs=2)
    engine.accountant.step(noise_multiplier=optimizer.noise_multiplier,
                           sample_rate=optimizer.sample_rate, steps=2 * len(loader))
    assert 3.0 - 0.05 <= engine.get_epsilon(1e-3) <= 3.0


def test_unreachable_target_epsilon_is_a_privacy_error_naming_it():
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    model = tiny_model()
    with pytest.raises(PrivacyError, match="target_epsilon"):
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=_loader(batch_size=N), max_grad_norm=1.0, target_epsilon=1e-9,
            target_delta=1e-5, epochs=1000)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"noise_multiplier": -1.0}, PrivacyError, "noise_multiplier"),
    ({"max_grad_norm": 0.0}, PrivacyError, "max_grad_norm"),
    ({"data_loader": _loader(batch_size=N + 1)}, PrivacyError, "data_loader"),
    ({"clipping": "huber"}, ConfigError, "clipping"),
    ({"grad_sample_mode": "magic"}, ConfigError, "grad_sample_mode"),
    ({"poisson_sampling": False}, ConfigError, "allow_non_poisson"),
    ({"noise_generator": torch.Generator()}, ConfigError, "noise_generator"),
    ({"clipping": "adaptive", "count_noise_std": 0.1}, PrivacyError, "count_noise_std"),
])
def test_bad_arguments_raise_an_error_naming_them(kwargs, error, name):
    engine = dptrain.PrivacyEngine(accountant="rdp", secure_mode="noise_generator" in kwargs)
    with pytest.raises(error, match=name):
        _private(engine=engine, **kwargs)


def test_an_optimizer_over_other_parameters_is_a_config_error_naming_optimizer():
    other = tiny_model()
    with pytest.raises(ConfigError, match="optimizer"):
        _private(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_loader_without_length_is_a_config_error_naming_data_loader():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(3)

    with pytest.raises(ConfigError, match="data_loader"):
        _private(data_loader=DataLoader(Stream(), batch_size=1))


def test_delta_not_below_one_over_n_warns_naming_delta():
    engine, *_ = _private()
    with pytest.warns(UserWarning, match="delta"):
        engine.get_epsilon(1.0 / N)


def test_non_poisson_loaders_need_the_flag_and_then_get_epsilon_warns():
    engine, model, optimizer, loader = _private(poisson_sampling=False, allow_non_poisson=True)
    _train_epoch(model, optimizer, loader)
    with pytest.warns(UserWarning, match="Poisson"):
        epsilon = engine.get_epsilon(1e-5)
    assert math.isfinite(epsilon)


def test_top_level_make_private_returns_the_engine_too():
    model = tiny_model()
    result = dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
                                  accountant="rdp", seed=0)
    _train_epoch(result.module, result.optimizer, result.data_loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert result.engine.get_epsilon(1e-5) > 0


def test_frozen_parameters_held_by_the_optimizer_get_no_noise_and_stay_fixed():
    model = tiny_model()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    _engine, private, optimizer, loader = _private(model=model)
    _train_epoch(private, optimizer, loader)
    assert torch.equal(frozen, before) and frozen.grad is None


def test_make_private_with_epsilon_refuses_a_noise_schedule():
    engine = dptrain.PrivacyEngine(accountant="gdp", seed=0)
    model = tiny_model()
    with pytest.raises(ConfigError, match="noise_schedule"):
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=_loader(), max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-3,
            epochs=1, noise_schedule={"kind": "exponential", "gamma": 0.9})


def _alternating(step: int) -> float:
    """q = 1 (every example) on even steps, q ~ 0 (empty batches) on odd steps."""
    return 1.0 if step % 2 == 0 else 1e-12


def _record_steps(optimizer) -> list:
    seen: list = []
    optimizer.attach_step_hook(lambda opt: seen.append((opt.sample_rate, opt.expected_batch_size)))
    return seen


def test_sampled_batch_size_expected_batch_size_and_accounted_q_agree_at_every_step():
    engine, model, optimizer, loader = _private(sample_rate_schedule=_alternating)
    seen, sizes = _record_steps(optimizer), []
    for x, y in loader:
        sizes.append(len(x))
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    accounted = [q for _, q, k in engine.accountant.history for _ in range(k)]
    assert sizes == [N if _alternating(t) == 1.0 else 0 for t in range(len(loader))]
    assert accounted == [_alternating(t) for t in range(len(loader))]
    assert seen == [(q, q * N) for q in accounted]


def test_a_loop_skipping_empty_batches_still_accounts_the_q_each_batch_was_sampled_with():
    engine, model, optimizer, loader = _private(sample_rate_schedule=_alternating)
    seen = _record_steps(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing to correct: the loader's q is the only q
        for x, y in loader:
            if len(x) == 0:
                continue  # the step is never taken, but the sampler has moved on
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert [q for _, q, _ in engine.accountant.history] == [1.0]
    assert seen == [(1.0, float(N))] * (len(loader) // 2)


def test_a_private_loader_drawing_at_another_rate_than_the_plan_is_charged_at_the_rate_it_drew():
    engine, model, optimizer, loader = _private()        # the plan's q: 8 / N
    loader.poisson_sampler.sample_rate = 0.5             # a pipeline changed the sampler's q
    seen, sizes = _record_steps(optimizer), []
    for x, y in loader:
        sizes.append(len(x))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert engine.plan.selection.sample_rate == 8 / N
    assert [q for _, q, _ in engine.accountant.history] == [0.5]
    assert seen == [(0.5, 0.5 * N)] * len(loader)
    assert sum(sizes) > 8 * len(loader)   # the batches really were drawn at q = 0.5


def test_the_engine_plans_each_steps_sample_rate_from_the_loaders_schedule():
    engine, _model, optimizer, loader = _private(sample_rate_schedule=_alternating)
    assert optimizer.sample_rate_schedule is None   # the loader's sampler is q's one evaluator
    assert [engine.sample_rate_at(t) for t in range(4)] == [_alternating(t) for t in range(4)]


def test_a_failed_make_private_leaves_the_model_unwrapped_so_a_retry_works():
    model = tiny_model()
    with pytest.raises(ConfigError, match="optimizer"):
        _private(model=model, optimizer=torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    _, private, optimizer, loader = _private(model=model)
    _train_epoch(private, optimizer, loader)
    assert optimizer.steps_taken == len(loader)


def test_two_poisson_batches_accumulated_into_one_step_are_refused():
    engine, model, optimizer, loader = _private(data_loader=_loader(batch_size=32))
    batches = iter(loader)
    for _ in range(2):   # gradient accumulation over two logical batches
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyError, match="two logical batches"):
        optimizer.step()
    assert len(engine.accountant) == 0


def test_gradients_discarded_by_zero_grad_do_not_block_the_next_batchs_step():
    engine, model, optimizer, loader = _private(data_loader=_loader(batch_size=32))
    batches = iter(loader)
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()   # computed, never stepped
    x, y = next(batches)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert len(engine.accountant) == 1


def test_stepping_while_iterating_the_original_loader_is_refused():
    original = _loader()
    engine, model, optimizer, _ = _private(data_loader=original)
    x, y = next(iter(original))   # not the private loader make_private returned
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyError, match="data loader returned by make_private"):
        optimizer.step()
    assert len(engine.accountant) == 0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_model_left_in_eval_mode_is_refused_not_trained_on_noise_alone(mode: str) -> None:
    import dptrain
    from dptrain.errors import UnsupportedModuleError

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.eval()   # as Hugging Face's from_pretrained returns a model
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))
    model, optimizer, loader = dptrain.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, 8), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode)
    x, y = next(x_y for x_y in loader if len(x_y[0]) > 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsupportedModuleError, match="in eval mode .* Call model.train"):
        optimizer.step()


def test_cyclic_poisson_sampling_on_a_fully_sharded_model_is_refused_naming_the_keys():
    from dptrain.privacy.selection import LoaderContext, Selection

    selection = Selection(0.1, kind="cyclic_poisson", groups=2)
    with pytest.raises(ConfigError, match="privacy.sampling=cyclic_poisson.*hardware=ddp"):
        selection.check_distributed(LoaderContext(distributed=True, sharded=True))


# -- the caller's loader charged as shuffled batches (sampling="given_shuffle") -----------------
def _first_column(batches) -> list[torch.Tensor]:
    return [x[:, 0] for x, _ in batches]


def test_given_shuffle_trains_the_callers_batches_and_charges_them_as_a_shuffle():
    original = _loader(batch_size=16)
    engine, model, optimizer, loader = _private(data_loader=original, sampling="given_shuffle")
    seen = []
    for _ in range(2):
        for x, y in loader:
            seen.append(x[:, 0])
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(seen, _first_column(original) * 2))
    assert engine.plan.selection.kind == "given_shuffle" and engine.plan.selection.shuffled
    shuffle = dptrain.accounting.get_accountant("rdp", "shuffle")
    shuffle.step(noise_multiplier=1.0, sample_rate=16 / N, steps=8)
    assert engine.get_epsilon(1e-5) == shuffle.get_epsilon(1e-5)  # 2 epochs, mu = 2 sqrt(2)


def test_given_shuffle_is_never_charged_less_than_dptrains_shuffle_of_the_same_loader():
    """drop_last=True over 64 examples in batches of 24: 2 batches a pass, where dptrain's own
    shuffle makes epochs of ceil(64 / 24) = 3 steps; the same steps cost at least as much."""
    epsilons = {}
    for sampling in ("given_shuffle", "shuffle"):
        loader = DataLoader(_loader().dataset, batch_size=24, drop_last=True)
        engine, model, optimizer, private = _private(data_loader=loader, sampling=sampling)
        for step in range(6):
            x, y = next(iter(private))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        epsilons[sampling] = engine.get_epsilon(1e-5)
    assert epsilons["given_shuffle"] > epsilons["shuffle"]  # 3 epochs against 2


def test_given_shuffle_refuses_a_loader_that_may_repeat_an_example_in_a_pass():
    data = _loader().dataset
    weighted = DataLoader(data, batch_size=8,
                          sampler=torch.utils.data.WeightedRandomSampler([1.0] * N, N))
    with pytest.raises(ConfigError, match="WeightedRandomSampler.*sampling='shuffle'"):
        _private(data_loader=weighted, sampling="given_shuffle")


def _steps(model, optimizer, loader, count: int) -> None:
    """`count` steps over `loader`, one per batch (loops restart it as needed)."""
    done = 0
    while done < count:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == count:
                return


def test_given_shuffle_loads_a_history_saved_at_a_pass_end_and_refuses_one_saved_mid_pass():
    saved, model, optimizer, loader = _private(sampling="given_shuffle")  # passes of 8 batches
    _steps(model, optimizer, loader, 8)
    at_pass_end = saved.state_dict()
    _steps(model, optimizer, loader, 3)
    engine = _private(sampling="given_shuffle")[0]
    engine.load_state_dict(at_pass_end)
    assert len(engine.accountant) == 8
    with pytest.raises(PrivacyError, match="11 steps.*0 batches into a pass of 8"):
        engine.load_state_dict(saved.state_dict())
    assert len(engine.accountant) == 8  # left as it was


# -- dptrain's shuffle (sampling="shuffle"): steps stay on the accountant's epochs ---------------

@pytest.mark.parametrize("sampling", ["shuffle", "given_shuffle"])
def test_a_shuffle_refuses_a_step_after_a_skipped_batch(sampling):
    """A batch handed out and never stepped on would shift the shuffle's passes against the
    accountant's epochs of steps: step t must release batch t (dptrain's shuffle and the
    caller's loader kept as one)."""
    engine, model, optimizer, loader = _private(sampling=sampling)
    batches = iter(loader)
    next(batches)  # handed out, never stepped on (a loop that `continue`s)
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyError, match="handed out 2 batches"):
        optimizer.step()
    assert len(engine.accountant) == 0


def test_shuffle_accepts_a_loop_that_leaves_each_epochs_iterator_after_its_last_batch():
    """The command's loop takes len(loader) batches of each epoch's iterator and never asks it
    for the end; a new iterator then starts the next epoch (and max_steps leaves one mid-way)."""
    engine, model, optimizer, loader = _private(sampling="shuffle")  # 8 batches per epoch
    for steps in (8, 8, 3):
        batches = iter(loader)
        for _ in range(steps):
            x, y = next(batches)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert len(engine.accountant) == 19


@pytest.mark.parametrize("sampling", ["shuffle", "given_shuffle"])
def test_a_shuffle_refuses_an_accountant_that_stopped_inside_an_epoch(sampling):
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    engine.accountant.step(noise_multiplier=1.0, sample_rate=8 / N, steps=3)
    with pytest.raises(PrivacyError, match=f"holds 3 steps.*sampling='{sampling}'"):
        _private(engine, sampling=sampling)


def test_shuffle_refuses_to_resume_mid_epoch_without_the_epochs_shuffle():
    """OS-entropy randomness never saves the shuffle: the rest of an interrupted epoch would
    come from a new shuffle, and an example trained on before the interruption could be drawn
    again inside the same charged epoch."""
    saved, model, optimizer, loader = _private(dptrain.PrivacyEngine(accountant="rdp"),
                                               sampling="shuffle")  # OS entropy, epochs of 8
    _steps(model, optimizer, loader, 8)
    at_epoch_end = saved.state_dict()
    _steps(model, optimizer, loader, 3)
    engine = _private(dptrain.PrivacyEngine(accountant="rdp"), sampling="shuffle")[0]
    with pytest.raises(PrivacyError, match="3 batches into an epoch of 8"):
        engine.load_state_dict(saved.state_dict())
    assert len(engine.accountant) == 0  # left as it was
    engine.load_state_dict(at_epoch_end)
    assert len(engine.accountant) == 8


def test_shuffle_refuses_a_history_that_ends_mid_epoch_for_a_loader_at_an_epoch_start():
    saved, model, optimizer, loader = _private(sampling="shuffle")
    _steps(model, optimizer, loader, 3)
    engine = _private(sampling="shuffle")[0]
    with pytest.raises(PrivacyError, match="holds 3 steps.*0 batches into a pass of 8"):
        engine.load_accountant_state(saved.accountant.state_dict())
    assert len(engine.accountant) == 0


def test_a_reproducible_shuffle_resumed_mid_epoch_finishes_the_same_epoch():
    def reproducible():
        return dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)

    saved, model, optimizer, loader = _private(reproducible(), sampling="shuffle")
    _steps(model, optimizer, loader, 3)
    engine, model, optimizer, loader = _private(reproducible(), sampling="shuffle")
    engine.load_state_dict(saved.state_dict())
    _steps(model, optimizer, loader, 5)  # the rest of the first epoch: no refusal
    assert len(engine.accountant) == 8
    assert loader.poisson_sampler.position == 0


def test_shuffle_steps_once_per_logical_batch_split_into_physical_chunks():
    engine, model, optimizer, loader = _private(sampling="shuffle")  # batches of 8
    for _ in range(2):
        with dptrain.BatchMemoryManager(data_loader=loader, max_physical_batch_size=3,
                                        optimizer=optimizer) as chunks:
            for x, y in chunks:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert len(engine.accountant) == 16
