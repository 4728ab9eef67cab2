"""result.json of a failed job: written for a new run or a run the job changed, never over the
result of an earlier run that a refused attempt did not touch."""

from __future__ import annotations

from pathlib import Path

from dptrain.cli.results import (
    failed_result,
    failure_replaces_result,
    ledger_snapshot,
    read_result,
    write_result,
)


def _earlier_run(folder: Path) -> bytes:
    """A folder holding an earlier run's result.json and ledger; returns the ledger's bytes."""
    write_result(folder, failed_result(folder), ["train.epochs=1"])
    (folder / "privacy_ledger.json").write_text('{"status": "completed"}')
    return ledger_snapshot(folder)


def test_a_new_run_folder_records_the_failure(tmp_path: Path) -> None:
    assert failure_replaces_result(tmp_path, ledger_snapshot(tmp_path))


def test_an_attempt_refused_before_training_keeps_the_earlier_result(tmp_path: Path) -> None:
    before = _earlier_run(tmp_path)
    assert not failure_replaces_result(tmp_path, before)


def test_an_attempt_that_changed_the_ledger_records_its_failure(tmp_path: Path) -> None:
    before = _earlier_run(tmp_path)
    (tmp_path / "privacy_ledger.json").write_text('{"status": "failed"}')
    assert failure_replaces_result(tmp_path, before)


def test_the_snapshot_of_a_folder_without_ledger_is_none(tmp_path: Path) -> None:
    assert ledger_snapshot(tmp_path) is None and read_result(tmp_path) is None


def test_result_json_keeps_validation_metrics_in_its_labelled_private_object(
        tmp_path: Path) -> None:
    import dataclasses
    import json

    validated = dataclasses.replace(failed_result(tmp_path), status="completed", epsilon=1.0,
                                    delta=1e-5, test_accuracy=0.7, test_loss=0.3,
                                    val_accuracy=0.65, val_loss=0.4, val_perplexity=1.5)
    write_result(tmp_path, validated, ["dataset.validation_size=0.1"])
    record = json.loads((tmp_path / "result.json").read_text())
    private = record.pop("private")
    assert not {"val_accuracy", "val_loss", "val_perplexity"} & set(record)
    assert (record["test_accuracy"], record["epsilon"]) == (0.7, 1.0)
    assert (private["val_accuracy"], private["val_loss"], private["val_perplexity"]) == (
        0.65, 0.4, 1.5)
    assert "not covered by epsilon" in private["notice"].lower()
