"""Did-you-mean hints computed from the configs shipped in dptrain/conf."""

from dptrain.cli.suggest import config_groups, hints, known_keys


def test_groups_and_their_options_come_from_the_shipped_configs():
    groups = config_groups()
    assert set(groups) == {
        "model",
        "dataset",
        "privacy",
        "noise_schedule",
        "hardware",
        "optimizer",
        "recipe",
        "logger",
        "audit",
        "lr_schedule",
        "finetune",
    }
    assert {"mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm", "digits_quick"} <= set(
        groups["recipe"]
    )


def test_known_keys_include_group_keys_and_train_keys():
    keys = known_keys(config_groups())
    assert {
        "train.epochs",
        "privacy.noise_multiplier",
        "privacy.target_epsilon",
        "dataset.max_len",
    } <= keys


def test_valid_overrides_get_no_hint():
    assert (
        hints(
            [
                "model=mnist_cnn",
                "train.epochs=3",
                "+recipe=mnist_cnn",
                "-m",
                "hydra.run.dir=x",
                "+model.width=3",
                "privacy.noise_multiplier=0.5,1.0",
            ]
        )
        == []
    )


def test_an_unknown_key_without_a_close_match_lists_the_groups():
    (line,) = hints(["zzzz=1"])
    assert "no such config group or key" in line and "model" in line


def test_a_misspelt_option_in_a_sweep_list_is_found():
    (line,) = hints(["optimizer=sgd,adamm"])
    assert "did you mean optimizer=adam" in line


def test_a_missing_launcher_plugin_points_to_the_cluster_extra():
    (line,) = hints(["hydra/launcher=joblib"])
    assert "dptrain[cluster]" in line


def test_other_hydra_overrides_get_no_hint():
    assert hints(["hydra/job_logging=disabled", "hydra.run.dir=x"]) == []


def test_a_misspelt_option_in_a_list_of_options_gets_its_hint():
    assert hints(["logger=[jsonl,tensorbord]"]) == [
        "logger=tensorbord: did you mean logger=tensorboard? "
        "Options: csv, jsonl, mlflow, tensorboard, wandb."]
