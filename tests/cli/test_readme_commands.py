"""Every command of the README's shell blocks works as written: `dptrain` commands that need no
data run for real (the smoke test, in seconds), the others compose with `--cfg job` (a sweep:
its first point); `dptrain-privacy` and `dptrain-ledger` run (the ledger commands on run and
sweep folders made at the README's paths). Only installs and the test suite itself are not run."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

REPO = Path(__file__).resolve().parents[2]
NOT_RUN = {"pip": "installs the package", "pytest": "the test suite this test belongs to"}
MODULES = {"dptrain-privacy": "dptrain.cli.plan", "dptrain-ledger": "dptrain.cli.ledger_cmd"}
SMOKE_EXAMPLES = 1024  # dataset.max_samples caps the training and the test split alike


def readme_commands() -> list[list[str]]:
    """Each command (argv) of the README's bash blocks: continued lines joined, `&&` split,
    comments dropped."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv:
                    commands.append(argv)
    return commands


COMMANDS = readme_commands()
DPTRAIN = [c[1:] for c in COMMANDS if c[0] == "dptrain"]


def _run_script(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The console script `argv[0]` (its module's main) on `argv[1:]`, run from `cwd` in this
    process: (exit status, stdout, stderr)."""
    main = importlib.import_module(MODULES[argv[0]]).main
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        code = main(argv[1:])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_every_readme_command_is_one_this_file_checks() -> None:
    programs = {argv[0] for argv in COMMANDS}
    assert programs <= {"dptrain", *MODULES, *NOT_RUN}, programs
    assert {"dptrain", *MODULES} <= programs


def _first_point(args: list[str]) -> list[str]:
    """A sweep's command line as one run: -m dropped, each comma-separated list its first value."""
    return [arg if "=" not in arg else arg.split("=", 1)[0] + "=" + arg.split("=", 1)[1].split(",")[0]
            for arg in args if arg not in ("-m", "--multirun")]


@pytest.mark.parametrize("args", [a for a in DPTRAIN if "dataset.synthetic=true" not in a],
                         ids=" ".join)
def test_each_dptrain_command_needing_data_composes(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process([*_first_point(args), "--cfg", "job"], tmp_path, monkeypatch,
                                    capsys)
    assert code == 0, err
    assert "privacy:" in out and "train:" in out


# Datasets that a fresh machine holds only after a download (digits is embedded; dataset=text
# reads the files the command names).
DOWNLOADED = {"mnist", "cifar10", "imdb", "glue_sst2", "e2e_nlg"}


@pytest.mark.parametrize("args", [a for a in DPTRAIN if "dataset.synthetic=true" not in a],
                         ids=" ".join)
def test_each_dptrain_command_needing_a_download_allows_it(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Run as written on a fresh machine, a command whose data is not on disk must download it
    (without dataset.download=true it stops, naming the key)."""
    import yaml

    code, out, err = run_in_process([*_first_point(args), "--cfg", "job"], tmp_path, monkeypatch,
                                    capsys)
    assert code == 0, err
    dataset = yaml.safe_load(out)["dataset"]
    if dataset["name"] in DOWNLOADED and not dataset.get("synthetic"):
        assert dataset["download"] is True, f"add dataset.download=true to: dptrain {' '.join(args)}"


@pytest.mark.parametrize("args", [a for a in DPTRAIN if "dataset.synthetic=true" in a], ids=" ".join)
def test_each_dptrain_command_needing_no_data_runs_on_a_small_sample(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # its time is stated in the README as measured, not asserted (a timed test fails under load)
    code, _, err = run_in_process([*args, "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert read_json(tmp_path / "run" / "result.json")["status"] == "completed"
    assert read_json(tmp_path / "run" / "privacy_ledger.json")["dataset"]["size"] <= SMOKE_EXAMPLES


@pytest.mark.parametrize("argv", [c for c in COMMANDS if c[0] == "dptrain-privacy"], ids=" ".join)
def test_each_dptrain_privacy_command_runs(argv: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_script(argv, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "prv" in out and "rdp" in out


def test_each_dptrain_ledger_command_checks_the_run_and_sweep_folders_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dptrain.cli.ledger_cmd import _parser

    commands = [c for c in COMMANDS if c[0] == "dptrain-ledger"]
    folders = {str(path) for argv in commands for path in _parser().parse_args(argv[1:]).paths}
    for folder in sorted(folders):   # a run folder, or a sweep folder with one job
        run = f"{folder}/0" if folder.startswith("multirun/") else folder
        code, _, err = run_in_process(["train.max_steps=1", f"hydra.run.dir={run}", *QUIET],
                                      tmp_path, monkeypatch, capsys)
        assert code == 0, err
    for argv in commands:
        code, out, err = _run_script(argv, tmp_path, monkeypatch, capsys)
        assert code == 0, out + err
        assert "matches" in out
