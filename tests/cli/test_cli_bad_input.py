"""Bad input stops `dptrain` before training: short message naming the key and the fix, exit != 0.

Most cases call the real entry point in-process (fast); one runs it as a subprocess to check the
exit status and the absence of a traceback end to end.
"""

import pytest

from dptrain.errors import ConfigError
from dptrain_runner import QUIET, run_dptrain, run_in_process


@pytest.fixture
def dptrain(tmp_path, monkeypatch, capsys):
    def call(*args):
        code, _, err = run_in_process(list(args), tmp_path, monkeypatch, capsys)
        assert code != 0
        assert "Traceback" not in err
        return err

    return call


def test_a_misspelt_config_group_suggests_the_right_one(dptrain):
    assert "did you mean model=mnist_cnn" in dptrain("modle=mnist_cnn")


def test_a_misspelt_group_option_suggests_the_right_one(dptrain):
    assert "did you mean +recipe=mnist_cnn" in dptrain("+recipe=mnist_cn")


def test_a_misspelt_key_suggests_the_right_one(dptrain):
    assert "did you mean train.epochs=3" in dptrain("train.epoch=3")


def test_an_unquoted_non_ascii_value_is_explained_with_the_quoted_override(dptrain):
    err = dptrain("hydra.run.dir=outputs/r\u00e9sum\u00e9")
    assert "an unquoted value may hold ASCII characters only" in err
    assert """'hydra.run.dir="outputs/r\u00e9sum\u00e9"'""" in err


def test_a_dataset_missing_offline_names_the_path_and_the_download_flag(dptrain, tmp_path):
    err = dptrain("+recipe=mnist_cnn", f"dataset.root={tmp_path / 'nothing'}", *QUIET)
    assert str(tmp_path / "nothing") in err and "dataset.download=true" in err


def test_a_model_failing_validation_lists_the_problems_and_the_fix(dptrain):
    err = dptrain(
        "model=custom",
        "model._target_=torchvision.models.resnet18",
        "+model.num_classes=10",
        "dataset=cifar10",
        "dataset.synthetic=true",
        "dataset.max_samples=64",
        "train.batch_size=16",
        *QUIET,
    )
    assert "BatchNorm2d" in err and "ModuleValidator.fix" in err
    assert "model=torchvision.models.resnet18 cannot be trained" in err and "privacy=none" in err


def test_a_model_that_does_not_fit_the_dataset_is_refused(dptrain):
    err = dptrain("model=mnist_cnn", *QUIET)
    assert "model=mnist_cnn cannot take dataset=digits inputs" in err


def test_a_custom_model_without_target_asks_for_it(dptrain):
    assert "model._target_" in dptrain("model=custom", *QUIET)


def test_privacy_with_neither_target_epsilon_nor_sigma_is_refused(dptrain):
    err = dptrain("privacy.target_epsilon=null", *QUIET)
    assert "privacy.target_epsilon" in err and "privacy.noise_multiplier" in err


def test_a_physical_batch_above_the_logical_batch_is_refused(dptrain):
    err = dptrain("train.batch_size=32", "train.max_physical_batch_size=64", *QUIET)
    assert "train.max_physical_batch_size" in err and "<=32" in err


def test_a_noise_schedule_with_a_target_epsilon_is_refused(dptrain):
    err = dptrain("noise_schedule=exponential", *QUIET)
    assert "noise_schedule=exponential needs privacy=sigma" in err


def test_verbose_flag_raises_with_the_traceback(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="max_physical_batch_size"):
        run_in_process(
            ["-v", "train.batch_size=32", "train.max_physical_batch_size=64", *QUIET],
            tmp_path,
            monkeypatch,
            capsys,
        )


def test_bad_input_leaves_no_training_outputs(dptrain, tmp_path):
    dptrain("train.batch_size=32", "train.max_physical_batch_size=64", "hydra.run.dir=run", *QUIET)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "privacy_ledger.json").exists()


def test_the_command_exits_with_status_2_and_no_traceback_on_bad_input(tmp_path):
    result = run_dptrain(
        ["train.batch_size=32", "train.max_physical_batch_size=64", *QUIET], tmp_path
    )
    assert result.returncode == 2
    assert "train.max_physical_batch_size" in result.stderr and "Traceback" not in result.stderr


def test_a_model_target_that_cannot_be_imported_names_model_target(dptrain):
    err = dptrain("model=custom", "model._target_=nowhere.Net", *QUIET)
    assert "model._target_=nowhere.Net" in err


def test_an_argument_the_model_does_not_take_is_named(dptrain):
    err = dptrain("+model.depth=3", *QUIET)
    assert "depth" in err and "digits_mlp" in err


def test_an_added_misspelt_train_key_is_refused_not_ignored(dptrain):
    err = dptrain("+train.epoch=1", *QUIET)   # what Hydra itself suggests for train.epoch=1
    assert "train.epoch" in err and "did you mean train.epochs" in err.lower()


def test_an_unknown_privacy_key_is_refused_naming_the_close_one(dptrain):
    err = dptrain("privacy=sigma", "+privacy.max_grad_nrom=2.0", *QUIET)
    assert "privacy.max_grad_nrom" in err and "privacy.max_grad_norm" in err


def test_an_option_the_dataset_does_not_take_is_refused(dptrain):
    err = dptrain("+dataset.vocab_size=100", *QUIET)
    assert "dataset.vocab_size" in err and "dataset=digits" in err


def test_an_unwritable_run_folder_is_named_without_a_traceback(dptrain, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    err = dptrain("hydra.run.dir=a_file/run", *QUIET)
    assert "hydra.run.dir" in err and "cannot be written" in err


def test_an_unwritable_sweep_folder_is_named_without_a_traceback(dptrain, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    err = dptrain("-m", "hydra.sweep.dir=a_file/sweep", "train.seed=0,1", *QUIET)
    assert "hydra.sweep.dir" in err and "cannot be written" in err


def test_a_suggestion_never_names_an_internal_key(dptrain):
    err = dptrain("model.targt_=x", *QUIET)
    assert "did you mean" in err and "model._target_" not in err


def test_a_key_of_another_dataset_option_names_that_option(dptrain):
    err = dptrain("dataset.train_file=x.csv", *QUIET)
    assert "dataset.train_file is a key of dataset=text" in err
    assert "dataset=text dataset.train_file=x.csv" in err


def test_a_target_epsilon_with_privacy_sigma_names_privacy_epsilon_and_the_budget_cap(dptrain):
    err = dptrain("privacy=sigma", "privacy.target_epsilon=8", *QUIET)
    assert "privacy.target_epsilon is a key of privacy=epsilon" in err
    assert "+privacy.target_epsilon=8" in err


def test_a_negative_learning_rate_is_refused_naming_optimizer_lr(dptrain):
    err = dptrain("optimizer.lr=-0.1", "train.max_steps=1", *QUIET)
    assert "optimizer.lr=-0.1 is not accepted: optimizer.lr takes a finite number >= 0" in err


def test_a_target_delta_not_below_one_over_n_is_refused_naming_the_key(dptrain):
    err = dptrain("privacy.target_delta=0.01", "train.max_steps=1", *QUIET)
    assert "privacy.target_delta=0.01 is not below 1/N" in err and "N = 1442" in err


def test_an_unreachable_target_epsilon_is_explained_in_config_keys(dptrain):
    err = dptrain("privacy.target_epsilon=0.001", "train.epochs=1", *QUIET)
    assert "privacy.target_epsilon=0.001 cannot be reached" in err
    assert "train.epochs=1 at train.batch_size=128" in err
    assert "sample_rate=" not in err and "steps=" not in err
