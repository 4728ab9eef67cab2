"""`dptrain --help` lists the config groups, their options and the recipes."""

from dptrain_runner import run_dptrain


def test_help_lists_every_group_and_recipe(tmp_path):
    result = run_dptrain(["--help"], tmp_path)
    assert result.returncode == 0
    for group in (
        "model:",
        "dataset:",
        "privacy:",
        "noise_schedule:",
        "hardware:",
        "optimizer:",
        "recipe:",
    ):
        assert group in result.stdout
    for recipe in ("mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm", "digits_quick"):
        assert f"\n{recipe} " in result.stdout
    assert "+recipe=NAME" in result.stdout


def test_python_dash_m_dptrain_is_the_dptrain_command(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dptrain", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "model:" in result.stdout and "+recipe=NAME" in result.stdout
