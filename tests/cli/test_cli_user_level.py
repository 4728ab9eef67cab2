"""`dptrain privacy.unit=user dataset.user_column=COLUMN`: user-level DP through the real command,
offline (a tiny BERT saved by tests/hf_tiny.py, trained on a CSV written here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

from tests.hf_tiny import review_rows, save_tiny, write_csv

ROWS, USERS, BATCH = 36, 9, 3


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user_cli")
    save_tiny(root / "bert", "bert")
    rows = [{**row, "author": f"user{i % USERS}"} for i, row in enumerate(review_rows(ROWS))]
    write_csv(root / "train.csv", rows)
    return root


def _args(run_dir: Path, *extra: str) -> list[str]:
    return [*QUIET, "model=hf", "model.name_or_path=./bert", "dataset=text",
            "dataset.train_file=train.csv", "dataset.text_column=review", "dataset.max_len=16",
            "privacy=sigma", "privacy.noise_multiplier=1.0", "train.epochs=1",
            f"train.batch_size={BATCH}", "train.max_physical_batch_size=3",
            f"hydra.run.dir={run_dir}", *extra]


def test_a_user_level_run_on_a_csv_with_a_user_column_trains_and_its_ledger_says_unit_user(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = files / "runs" / "user"
    code, out, err = run_in_process(
        _args(run_dir, "privacy.unit=user", "dataset.user_column=author",
              "privacy.max_examples_per_user=2"), files, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(run_dir / "privacy_ledger.json")
    mechanism = ledger["mechanism"]
    assert ledger["status"] == "completed"
    assert mechanism["privacy_unit"].startswith("one user: all their training examples")
    assert mechanism["num_users"] == USERS and mechanism["max_examples_per_user"] == 2
    assert mechanism["sample_rate"] == pytest.approx(BATCH / USERS)
    assert ledger["history"][0]["sample_rate"] == pytest.approx(BATCH / USERS)
    assert "one user: all their training examples" in " ".join(out.split())


def test_a_user_level_runs_default_delta_counts_users_not_examples(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = files / "runs" / "user_delta"
    code, _, err = run_in_process(
        _args(run_dir, "privacy.unit=user", "dataset.user_column=author", "train.max_steps=1"),
        files, monkeypatch, capsys)
    assert code == 0, err
    assert read_json(run_dir / "privacy_ledger.json")["delta"] == 0.01  # 1/(10 N), N = 9 users


def test_privacy_unit_user_without_a_user_column_is_a_config_error_naming_it(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_in_process(_args(files / "runs" / "no_column", "privacy.unit=user"),
                                  files, monkeypatch, capsys)
    assert code != 0
    assert "dataset.user_column" in err and "Traceback" not in err


def test_an_unknown_privacy_unit_is_refused_naming_the_key_and_its_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_in_process([*QUIET, "privacy.unit=person"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in err
    assert "privacy.unit" in err and "example" in err and "user" in err


def _authored(moved: tuple[int, ...] = ()) -> list[dict[str, object]]:
    """The fixture's rows; each row in `moved` written by the next user instead (the same
    texts and labels, the same USERS users)."""
    return [{**row, "author": f"user{(i + (i in moved)) % USERS}"}
            for i, row in enumerate(review_rows(ROWS))]


def test_a_cli_resume_after_two_rows_changed_user_is_charged_anew_not_replayed(
        files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bert").symlink_to(files / "bert")
    run_dir = tmp_path / "run"
    user_run = ["privacy.unit=user", "dataset.user_column=author",
                "privacy.reproducible_mechanism=true", "train.epochs=2"]
    write_csv(tmp_path / "train.csv", _authored())
    code, _, err = run_in_process(_args(run_dir, *user_run), tmp_path, monkeypatch, capsys)
    assert code == 0, err
    first = read_json(run_dir / "privacy_ledger.json")
    write_csv(tmp_path / "train.csv", _authored(moved=(4, 11)))   # two rows: another user
    code, _, err = run_in_process(
        _args(run_dir, *user_run, f"train.resume={run_dir / 'checkpoints' / 'epoch_1.pt'}"),
        tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(run_dir / "privacy_ledger.json")
    steps = first["steps_completed"]               # 2 epochs of USERS / BATCH steps
    assert ledger["resumes"][-1]["charged_steps"] == steps // 2   # epoch 2 charged twice
    assert sum(run["steps"] for run in ledger["history"]) == steps + steps // 2
    assert ledger["epsilon"] > first["epsilon"]
    assert len(ledger["dataset"]["user_fingerprints"]) == 2
    assert ledger["dataset"]["fingerprints"] == first["dataset"]["fingerprints"]


@pytest.mark.parametrize("chunk", ["train.max_physical_batch_size=null", "train.max_physical_batch_size=3"])
def test_a_user_level_run_is_sized_from_its_users_not_its_rows(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, chunk: str) -> None:
    """train.batch_size and train.epochs null (model=hf's default): the sizing rule counts the
    privacy units, as the batch and the sample rate do at user level (36 rows would give a batch
    of 16 of the 9 users); a physical chunk size is checked against the sized batch, not a
    stand-in of 1."""
    from dptrain.train.settings import sized_for

    run_dir = files / "runs" / f"user_sized_{chunk.split('=')[1]}"
    args = [a for a in _args(run_dir, "privacy.unit=user", "dataset.user_column=author",
                             "train.max_steps=1") if not a.startswith(("train.epochs", "train.batch_size", "train.max_physical"))]
    code, _, err = run_in_process(args + ["train.epochs=null", "train.batch_size=null", chunk],
                                  files, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(run_dir / "privacy_ledger.json")
    batch, epochs = sized_for(USERS)
    assert (ledger["config"]["train"]["batch_size"], ledger["config"]["train"]["epochs"]) == (batch, epochs)
    assert ledger["history"][0]["sample_rate"] == pytest.approx(batch / USERS)
