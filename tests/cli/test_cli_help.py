"""`dptrain --help` lists the config groups, their options and the recipes."""

from dptrain_runner import run_in_process


def test_help_lists_every_group_and_recipe(tmp_path, monkeypatch, capsys):
    code, out, err = run_in_process(["--help"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    for group in (
        "model:",
        "dataset:",
        "privacy:",
        "noise_schedule:",
        "hardware:",
        "optimizer:",
        "recipe:",
    ):
        assert group in out
    for recipe in ("mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm", "digits_quick"):
        assert f"\n{recipe} " in out
    assert "+recipe=NAME" in out


def test_python_dash_m_dptrain_is_the_dptrain_command(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dptrain", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "model:" in result.stdout and "+recipe=NAME" in result.stdout
