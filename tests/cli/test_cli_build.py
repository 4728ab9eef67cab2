"""Config -> objects (cli/build.py): settings checks, the delta rule, the non-private job."""

import pytest
import torch
from dptrain_runner import read_json
from hydra import compose, initialize_config_module

from dptrain.data.fingerprint import data_fingerprint
from dptrain.cli.build import build_job, build_settings, default_delta, privacy_mode
from dptrain.errors import ConfigError


def compose_config(*overrides):
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "n, delta",
    [(1442, 1e-5), (60_000, 1e-6), (50_000, 1e-6), (25_000, 1e-6), (1000, 1e-4), (999, 1e-4)],
)
def test_default_delta_is_one_over_ten_n_rounded_down_to_a_power_of_ten(n, delta):
    assert default_delta(n) == delta
    assert default_delta(n) <= 1 / (10 * n)


def test_train_settings_carry_every_train_key(tmp_path):
    cfg = compose_config("train.epochs=2", "train.max_steps=7", "train.keep_best=true")
    settings = build_settings(dict(cfg.train), tmp_path)
    assert (settings.epochs, settings.max_steps, settings.keep_best, settings.batch_size) == (
        2,
        7,
        True,
        128,
    )
    assert settings.run_dir == tmp_path


@pytest.mark.parametrize(
    "key, value", [("epochs", 0), ("batch_size", -1), ("max_steps", 0), ("eval_every", -1)]
)
def test_train_settings_refuse_non_positive_counts_naming_the_key(tmp_path, key, value):
    cfg = compose_config(f"train.{key}={value}")
    with pytest.raises(ConfigError, match=f"train.{key}"):
        build_settings(dict(cfg.train), tmp_path)


def test_a_hand_written_privacy_group_is_classified_by_its_keys():
    assert privacy_mode({"target_epsilon": 1.0}) == "epsilon"
    assert privacy_mode({"noise_multiplier": 1.0}) == "sigma"
    with pytest.raises(ConfigError, match="privacy=none"):
        privacy_mode({"max_grad_norm": 1.0})


def test_a_non_private_job_has_no_engine_and_a_shuffled_loader(tmp_path):
    job, settings = build_job(compose_config("privacy=none", "train.batch_size=64"), tmp_path)
    assert job.engine is None and not job.privacy.enabled
    assert job.train_loader.batch_size == 64
    assert job.dataset_name == "digits" and job.dataset_size == len(job.train_loader.dataset)
    assert job.config["privacy"] == {"name": "none"}


def test_the_job_config_is_fully_resolved_plain_data(tmp_path):
    job, _ = build_job(
        compose_config(
            "privacy=none",
            "dataset=imdb",
            "model=imdb_embedding",
            "dataset.synthetic=true",
            "dataset.max_samples=32",
            "dataset.vocab_size=100",
            "train.batch_size=8",
        ),
        tmp_path,
    )
    assert job.config["model"]["vocab_size"] == 100
    assert isinstance(job.config, dict)


def test_the_same_seed_builds_the_same_initial_model(tmp_path):
    first, _ = build_job(compose_config("privacy=none", "train.seed=4"), tmp_path)
    second, _ = build_job(compose_config("privacy=none", "train.seed=4"), tmp_path)
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_an_unavailable_cuda_device_is_refused_when_no_gpu_is_visible(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="hardware=cpu"):
        build_job(compose_config("privacy=none", "hardware=cuda"), tmp_path)


def test_a_batch_larger_than_the_dataset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.batch_size"):
        build_job(
            compose_config("privacy=none", "dataset.max_samples=50", "train.batch_size=64"),
            tmp_path,
        )


def test_a_null_target_delta_is_chosen_by_the_rule_and_said_in_the_log(tmp_path, caplog):
    with caplog.at_level("INFO", logger="dptrain.cli.build"):
        job, _ = build_job(
            compose_config("privacy=sigma", "dataset.max_samples=500", "train.batch_size=50"),
            tmp_path,
        )
    assert job.privacy.target_delta == 1e-4
    assert "1/(10 N)" in caplog.text and "N = 500" in caplog.text


def test_a_configured_target_delta_is_used_as_given(tmp_path):
    job, _ = build_job(compose_config("privacy=sigma", "privacy.target_delta=3e-6"), tmp_path)
    assert job.privacy.target_delta == 3e-6


def test_a_noise_multiplier_in_an_epsilon_config_is_refused_not_calibrated_over(tmp_path):
    with pytest.raises(ConfigError, match="privacy.noise_multiplier=0.01 would not be used"):
        build_job(compose_config("+privacy.noise_multiplier=0.01"), tmp_path)


def test_a_target_epsilon_with_a_given_sigma_becomes_the_budget_guards_target(tmp_path):
    job, _ = build_job(compose_config("privacy=sigma", "+privacy.target_epsilon=2.0"), tmp_path)
    assert (job.privacy.plan.noise.multiplier, job.privacy.target_epsilon) == (1.0, 2.0)


def test_a_given_sigma_without_target_epsilon_has_no_budget_cap(tmp_path):
    job, _ = build_job(compose_config("privacy=sigma"), tmp_path)
    assert job.privacy.target_epsilon is None


@pytest.mark.parametrize(
    "override, key",
    [("+train.epoch=3", "train.epoch"), ("+privacy.max_grad_nrom=2", "privacy.max_grad_nrom")],
)
def test_an_added_key_that_would_be_ignored_is_refused_before_the_data_is_loaded(
    tmp_path, monkeypatch, override, key
):
    import dptrain.cli.build as build

    monkeypatch.setattr(build, "build_dataset", lambda *a, **k: pytest.fail("data was loaded"))
    with pytest.raises(ConfigError, match=key):
        build_job(compose_config(override), tmp_path)


def test_the_transformer_config_follows_the_datasets_vocabulary_and_length(tmp_path):
    job, _ = build_job(
        compose_config(
            "privacy=none",
            "model=transformer",
            "model.n_embd=16",
            "dataset=imdb",
            "dataset.synthetic=true",
            "dataset.max_samples=16",
            "dataset.vocab_size=100",
            "dataset.max_len=12",
            "train.batch_size=8",
        ),
        tmp_path,
    )
    assert (job.config["model"]["vocab_size"], job.config["model"]["seq_len"]) == (104, 12)
    assert job.model.tok_emb.num_embeddings == 100 + 4 and job.model.pos_emb.num_embeddings == 12


def test_a_validation_split_is_held_out_of_the_n_the_accountant_and_the_ledger_count(tmp_path):
    from dptrain.train.loop import train

    job, settings = build_job(
        compose_config("privacy=sigma", "dataset.validation_size=0.2", "train.batch_size=64",
                       "train.max_steps=2", "train.progress=false"),
        tmp_path,
    )
    n = len(job.train_loader.dataset)   # each row held out with probability 0.2
    assert job.dataset_size == n and abs(n - 0.8 * 1442) < 4 * (0.16 * 1442) ** 0.5
    assert len(job.validation_loader.dataset) == 1442 - n
    train(job, settings)
    ledger = read_json(tmp_path / "privacy_ledger.json")
    (split,) = ledger["dataset"].pop("private_preprocessing")   # the split read the rows
    assert split.startswith(f"dataset.validation_size=0.2 held out {1442 - n} of the 1442 ")
    assert ledger["dataset"] == {"name": "digits", "size": n, "validation_size": 1442 - n,
                                 "synthetic": False,
                                 "fingerprints": [data_fingerprint(job.train_loader.dataset)]}
    assert ledger["mechanism"]["sample_rate"] == 64 / n
    assert ledger["history"] == [{"noise_multiplier": 1.0, "sample_rate": 64 / n, "steps": 2}]


def test_keep_best_without_a_validation_split_is_refused_before_the_data_is_loaded(
    tmp_path, monkeypatch
):
    import dptrain.cli.build as build

    monkeypatch.setattr(build, "build_dataset", lambda *a, **k: pytest.fail("data was loaded"))
    with pytest.raises(ConfigError, match="dataset.validation_size"):
        build_job(compose_config("train.keep_best=true"), tmp_path)


def test_the_mechanism_is_seeded_from_os_entropy_unless_privacy_reproducible_mechanism_is_set(
    tmp_path,
):
    default, _ = build_job(compose_config("dataset.max_samples=200"), tmp_path / "a")
    opted, _ = build_job(
        compose_config("dataset.max_samples=200", "privacy.reproducible_mechanism=true"),
        tmp_path / "b",
    )
    assert default.engine.randomness() == "os_entropy"
    assert opted.engine.randomness() == "reproducible"
    assert opted.engine.mechanism_replays() and not default.engine.mechanism_replays()


def test_a_reproducible_mechanism_with_secure_mode_is_refused_naming_both_keys(tmp_path):
    cfg = compose_config("privacy.reproducible_mechanism=true", "privacy.secure_mode=true")
    with pytest.raises(ConfigError, match=r"reproducible_mechanism.*secure_mode"):
        build_job(cfg, tmp_path)


def _test_size(tmp_path, *overrides):
    job, _ = build_job(compose_config("dataset=digits", *overrides), tmp_path)
    return len(job.test_loader.dataset)


def test_a_synthetic_smoke_test_evaluates_as_many_test_examples_as_it_trains_on(tmp_path):
    assert _test_size(tmp_path, "dataset.synthetic=true", "train.max_steps=2",
                      "train.batch_size=64") == 2 * 64


def test_real_data_or_a_run_without_max_steps_evaluates_the_whole_test_split(tmp_path):
    whole = _test_size(tmp_path / "a", "dataset.synthetic=true", "train.batch_size=64")
    assert whole == 355
    assert _test_size(tmp_path / "b", "train.max_steps=2", "train.batch_size=64") == whole


@pytest.mark.parametrize("overrides, words", [
    (("privacy.sampling=cyclic",), "privacy.sampling"),
    (("privacy.sampling=poisson", "privacy.poisson_sampling=false"), "privacy.sampling alone"),
    (("privacy.sampling=poisson", "privacy.sampling_groups=2"), "privacy.sampling_groups"),
    (("privacy.sampling=cyclic_poisson", "privacy.sampling_groups=0"), "privacy.sampling_groups"),
])
def test_an_unusable_batch_selection_is_refused_naming_its_key(overrides, words, tmp_path):
    with pytest.raises(ConfigError, match=words):
        build_job(compose_config("privacy=sigma", *overrides), tmp_path)


def test_privacy_epsilon_with_cyclic_poisson_calibrates_sigma_for_the_rounds_of_its_groups(
        tmp_path):
    from dptrain.accounting import compute_epsilon

    job, settings = build_job(compose_config("privacy=epsilon", "privacy.sampling=cyclic_poisson",
                                             "privacy.sampling_groups=2",
                                             "privacy.target_epsilon=8"), tmp_path)
    plan = job.privacy.plan
    steps = settings.epochs * plan.selection.steps_per_epoch
    spent = compute_epsilon([(plan.noise.multiplier, plan.selection.sample_rate, steps)],
                            plan.delta, plan.accountant, plan.accounting)
    assert (plan.selection.kind, plan.selection.groups) == ("cyclic_poisson", 2)
    assert 8 - 0.01 <= spent <= 8
    assert job.engine.plan == plan and type(job.train_loader).__name__ == "CyclicPoissonDataLoader"


def test_privacy_epsilon_with_shuffled_batches_calibrates_sigma_with_the_shuffled_accounting(
        tmp_path):
    from dptrain.accounting.shuffle import shuffle_epsilon

    job, settings = build_job(compose_config("privacy=epsilon", "privacy.sampling=shuffle",
                                             "privacy.target_epsilon=8"), tmp_path)
    plan = job.privacy.plan
    steps = settings.epochs * plan.selection.steps_per_epoch
    spent = shuffle_epsilon([(plan.noise.multiplier, plan.selection.sample_rate, steps)],
                            plan.delta)
    assert plan.selection.kind == "shuffle" and 8 - 0.01 <= spent <= 8


def test_a_private_job_validates_its_model_once(tmp_path, monkeypatch):
    from dptrain.validation import ModuleValidator

    validated = []
    validate = ModuleValidator.validate

    def counting(model):
        validated.append(model)
        return validate(model)

    monkeypatch.setattr(ModuleValidator, "validate", staticmethod(counting))
    job, _ = build_job(compose_config("privacy=sigma", "train.batch_size=64"), tmp_path)
    model = job.model._module   # the model the per-sample gradient wrapper holds
    assert sum(seen is model for seen in validated) == 1
