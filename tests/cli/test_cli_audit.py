"""`dptrain audit` (alias `+audit=one_run`) through the real command: audit.json beside the
ledger, the ledger's record of the audit, resume, and bad input refused before training."""

from pathlib import Path

import pytest

from dptrain.cli.audit import expand_subcommand
from dptrain.train.ledger import load_ledger
from dptrain_runner import QUIET, read_json, run_in_process, run_once_in_process

SHORT = [*QUIET, "train.epochs=2", "audit.canaries=200"]


@pytest.fixture
def dptrain(tmp_path, monkeypatch, capsys):
    def call(*args):
        return run_in_process(list(args), tmp_path, monkeypatch, capsys)

    return call


def _refused(dptrain, *args) -> str:
    code, _, err = dptrain(*args)
    assert code != 0 and "Traceback" not in err
    return err


def test_the_audit_subcommand_selects_the_one_run_audit():
    argv = ["dptrain", "audit", "audit.canaries=5"]
    expand_subcommand(argv)
    assert argv == ["dptrain", "+audit=one_run", "audit.canaries=5"]
    argv = ["dptrain", "audit", "+audit=one_run"]
    expand_subcommand(argv)
    assert argv == ["dptrain", "+audit=one_run"]


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> tuple[Path, int, str, str]:
    """(run folder, exit status, stdout, stderr) of one audited run, read by several tests.

    It is asked for with the command-line alias `+audit=one_run`, which `dptrain audit` expands to
    (test_the_audit_subcommand_selects_the_one_run_audit); the other runs here use `dptrain audit`.
    """
    cwd = tmp_path_factory.mktemp("audited")
    code, out, err = run_once_in_process(["+audit=one_run", *SHORT,
                                          f"hydra.run.dir={cwd / 'run'}"], cwd)
    return cwd / "run", code, out, err


def test_an_audited_run_writes_audit_json_beside_the_ledger_and_records_it(audited):
    run_dir, code, out, err = audited
    assert code == 0, err
    audit = read_json(run_dir / "audit.json")
    ledger = load_ledger(run_dir)  # still valid against the ledger schema
    assert audit["kind"] == "white_box" and audit["canaries"] == 200
    assert audit["claimed_epsilon"] == pytest.approx(ledger["epsilon"])
    assert ledger["audit"]["lower_bound"] == audit["lower_bound"]
    assert ledger["audit"]["file"] == "audit.json" and ledger["config"]["audit"]["canaries"] == 200
    assert (run_dir / "audit_scores.png").exists()
    assert "empirical lower bound" in out and "consistent" in out


@pytest.mark.parametrize("noise", [["privacy.noise=banded", "privacy.noise_bands=4"],
                                   ["privacy.noise=blt"]], ids=["banded", "blt"])
def test_a_run_with_correlated_noise_is_audited_against_its_own_epsilon(dptrain, tmp_path, noise):
    code, _, err = dptrain("audit", *SHORT, *noise, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, err
    audit = read_json(tmp_path / "run" / "audit.json")
    ledger = load_ledger(tmp_path / "run")
    assert ledger["plan"]["noise"]["strategy"]["name"] == noise[0].split("=")[1]
    assert audit["claimed_epsilon"] == pytest.approx(ledger["epsilon"])
    assert 0 <= audit["lower_bound"] <= audit["claimed_epsilon"]


def test_an_audited_run_prints_where_it_wrote_the_audit_and_its_figure(audited):
    run_dir, code, out, err = audited
    assert code == 0, err
    assert str(run_dir / "audit.json") in out
    assert str(run_dir / "audit_scores.png") in out


def test_a_black_box_audit_relabels_canaries_taken_from_the_training_set(dptrain, tmp_path):
    plain_code, _, _ = dptrain(*QUIET, "train.max_steps=1", f"hydra.run.dir={tmp_path / 'p'}")
    code, _, _ = dptrain("audit", *SHORT, "audit.kind=black_box", f"hydra.run.dir={tmp_path / 'b'}")
    assert plain_code == 0 and code == 0
    audit = read_json(tmp_path / "b" / "audit.json")
    size = load_ledger(tmp_path / "p")["dataset"]["size"]
    assert audit["kind"] == "black_box" and audit["score"] == "loss"
    assert load_ledger(tmp_path / "b")["dataset"]["size"] == size - 200 + audit["included"]


def test_a_resumed_audited_run_ends_with_the_scores_of_an_uninterrupted_one(dptrain, tmp_path):
    same = [*SHORT, "privacy.reproducible_mechanism=true"]  # an exact replay: same noise, batches
    whole, _, _ = dptrain("audit", *same, f"hydra.run.dir={tmp_path / 'whole'}")
    cut, _, _ = dptrain("audit", *same, "train.max_steps=12", f"hydra.run.dir={tmp_path / 'cut'}")
    resumed, _, _ = dptrain("audit", *same, "train.resume=auto",
                            f"hydra.run.dir={tmp_path / 'cut'}")
    assert whole == cut == resumed == 0
    expected = read_json(tmp_path / "whole" / "audit.json")
    got = read_json(tmp_path / "cut" / "audit.json")
    assert got["canary_scores"] == pytest.approx(expected["canary_scores"], rel=1e-9, abs=1e-12)
    assert got["lower_bound"] == expected["lower_bound"]


def test_auditing_a_non_private_run_is_refused(dptrain):
    err = _refused(dptrain, "audit", "privacy=none", *SHORT)
    assert "privacy=none" in err and "infinite" in err


def test_more_white_box_canaries_than_the_model_has_coordinates_are_refused(dptrain):
    err = _refused(dptrain, "audit", *QUIET, "audit.canaries=5000")
    assert "audit.canaries=5000 is more canaries than the model's trainable coordinates" in err


def test_more_black_box_canaries_than_training_examples_are_refused(dptrain):
    err = _refused(dptrain, "audit", *QUIET, "audit.kind=black_box", "audit.canaries=4000")
    assert "audit.canaries=4000 is more canaries than the training set allows" in err


@pytest.mark.parametrize("confidence", ["0", "1", "1.5"])
def test_a_confidence_outside_zero_one_is_refused(dptrain, confidence):
    err = _refused(dptrain, "audit", *QUIET, f"audit.confidence={confidence}")
    # the typed config (dptrain.cli.schema) holds audit.confidence as a float
    assert f"audit.confidence={float(confidence)} must be a probability in (0, 1)" in err


def test_an_unknown_audit_kind_is_refused(dptrain):
    assert "audit.kind='grey_box'" in _refused(dptrain, "audit", *QUIET, "audit.kind=grey_box")


def test_resuming_from_a_checkpoint_made_without_canaries_is_refused(dptrain, tmp_path):
    code, _, _ = dptrain(*QUIET, "train.epochs=1", f"hydra.run.dir={tmp_path / 'plain'}")
    assert code == 0
    last = tmp_path / "plain" / "checkpoints" / "last.pt"
    err = _refused(dptrain, "audit", *SHORT, f"train.resume={last}",
                   f"hydra.run.dir={tmp_path / 'audited'}")
    assert "train.resume" in err and "made without canaries" in err


def test_the_command_line_alias_audits_end_to_end(audited):
    run_dir, code, _, err = audited
    assert code == 0, err
    assert read_json(run_dir / "audit.json")["verdict"].startswith("consistent")


def test_an_audit_over_several_ranks_is_refused_naming_ddp_and_fsdp(dptrain, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr("dptrain.distributed.runtime.get_world_size", lambda: 2)
    err = _refused(dptrain, "audit", *SHORT, f"hydra.run.dir={tmp_path / 'run'}")
    assert "hardware=ddp or hardware=fsdp" in err and "hardware=cpu" in err
    assert not (tmp_path / "run" / "privacy_ledger.json").exists()
