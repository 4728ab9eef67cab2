"""Resume through the `dptrain` command: stop a run, `train.resume=auto`, same end as one run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dptrain_runner import QUIET, run_in_process

from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import epsilon_of, history_from_json, load_ledger
from tests.data.datasets.on_disk import write_mnist
from dptrain.formatting import format_epsilon

RUN = ["train.epochs=2", "hardware=cpu", *QUIET,   # digits: 12 logical steps per epoch
       "privacy.reproducible_mechanism=true"]   # an exact replay: same noise and batches


def _dptrain(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process([*RUN, *args], cwd, monkeypatch, capsys)
    assert code == 0, err


def _stopped_and_resumed_equals_straight(stop_at: int, extra: list[str], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped after `stop_at` steps and resumed (`train.resume=auto`) ends with the
    uninterrupted run's history, epsilon and weights."""
    _dptrain(["hydra.run.dir=straight", *extra], tmp_path, monkeypatch, capsys)
    _dptrain(["hydra.run.dir=stopped", f"train.max_steps={stop_at}", *extra], tmp_path,
             monkeypatch, capsys)
    assert load_ledger(tmp_path / "stopped")["steps_completed"] == stop_at
    _dptrain(["hydra.run.dir=stopped", "train.resume=auto", *extra], tmp_path, monkeypatch, capsys)
    straight, resumed = load_ledger(tmp_path / "straight"), load_ledger(tmp_path / "stopped")
    assert resumed["status"] == "completed" and resumed["history"] == straight["history"]
    assert resumed["epsilon"] == straight["epsilon"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "stopped" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dptrain_resume_auto_ends_where_an_uninterrupted_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _stopped_and_resumed_equals_straight(12, [], tmp_path, monkeypatch, capsys)


def test_dptrain_refuses_to_resume_with_another_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run", "train.max_steps=3"], tmp_path, monkeypatch, capsys)
    before = (tmp_path / "run" / "privacy_ledger.json").read_bytes()
    code, _, err = run_in_process([*RUN, "hydra.run.dir=run", "train.resume=auto",
                                   "optimizer.lr=0.5"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "optimizer.lr" in err
    assert (tmp_path / "run" / "privacy_ledger.json").read_bytes() == before


SHUFFLE = ["privacy.sampling=shuffle"]


def test_a_reproducible_shuffled_run_resumed_mid_epoch_ends_where_an_uninterrupted_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint holds the epoch's shuffle: the resumed steps draw its remaining batches,
    so the history (each epoch charged once) and the weights are the uninterrupted run's."""
    _stopped_and_resumed_equals_straight(5, SHUFFLE, tmp_path, monkeypatch, capsys)


def test_a_cyclic_poisson_run_resumed_mid_epoch_ends_where_an_uninterrupted_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The batches a resume draws again to replay the epoch's first steps are not counted as
    batches handed out for the next step (the optimizer refused the resumed step: 'handed out
    6 batches since the previous step'), and the groups stay on their steps."""
    cyclic = ["privacy.sampling=cyclic_poisson", "privacy.sampling_groups=2"]
    _stopped_and_resumed_equals_straight(5, cyclic, tmp_path, monkeypatch, capsys)


def test_a_shuffled_run_from_os_entropy_is_not_resumed_mid_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its shuffle is never saved: the rest of the epoch would come from a new one."""
    fresh = [*SHUFFLE, "privacy.reproducible_mechanism=false"]
    _dptrain(["hydra.run.dir=run", "train.max_steps=3", *fresh], tmp_path, monkeypatch, capsys)
    before = (tmp_path / "run" / "privacy_ledger.json").read_bytes()
    code, _, err = run_in_process([*RUN, "hydra.run.dir=run", "train.resume=auto", *fresh],
                                  tmp_path, monkeypatch, capsys)
    assert code != 0 and "privacy.reproducible_mechanism=true" in err and "epoch_N.pt" in err
    assert (tmp_path / "run" / "privacy_ledger.json").read_bytes() == before


def test_a_shuffled_run_from_os_entropy_resumes_at_an_epochs_end_charging_each_epoch_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = [*SHUFFLE, "privacy.reproducible_mechanism=false"]
    _dptrain(["hydra.run.dir=run", "train.max_steps=12", *fresh], tmp_path, monkeypatch, capsys)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["steps_in_epoch"] == 0
    _dptrain(["hydra.run.dir=run", "train.resume=auto", *fresh], tmp_path, monkeypatch, capsys)
    resumed = load_ledger(tmp_path / "run")
    history = history_from_json(resumed["history"])
    assert resumed["status"] == "completed" and sum(n for *_, n in history) == 24
    assert resumed["epsilon"] == pytest.approx(
        epsilon_of(history, resumed["delta"], resumed["accountant"], "shuffle"), rel=1e-12)


def test_resuming_a_finished_run_from_an_older_checkpoint_with_fewer_steps_keeps_every_step_charged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    finished = ["privacy=sigma", "train.epochs=3", "hardware=cpu", "hydra.run.dir=run", *QUIET,
                "train.keep_checkpoints=null",     # epoch_1.pt stays to resume from
                "privacy.reproducible_mechanism=true"]   # the exact replay: steps retaken once
    code, _, err = run_in_process(finished, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    released = load_ledger(tmp_path / "run")        # 36 steps; epoch_3.pt holds all of them
    code, _, err = run_in_process([*finished, "train.resume=run/checkpoints/epoch_1.pt",
                                   "train.max_steps=13"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = load_ledger(tmp_path / "run")
    assert ledger["status"] == "completed"
    assert ledger["history"] == released["history"] and ledger["epsilon"] == released["epsilon"]
    assert {"path": "checkpoints/epoch_3.pt", "step": 36} in [
        {"path": c["path"], "step": c["step"]} for c in ledger["checkpoints"]]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "epoch_3.pt")["step"] == 36


def test_a_resume_says_where_it_resumed_and_the_epsilon_spent_so_far(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=stopped", "train.max_steps=12"], tmp_path, monkeypatch, capsys)
    epsilon = load_ledger(tmp_path / "stopped")["epsilon"]
    code, out, err = run_in_process([*RUN, "hydra.run.dir=stopped", "train.resume=auto",
                                     "train.max_steps=13"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert (f"resumed from stopped/checkpoints/last.pt at step 12, epsilon so far {format_epsilon(epsilon)} "
            "(delta 1e-05)") in out


def test_resume_auto_in_an_empty_given_folder_says_it_found_nothing_and_starts_at_step_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process([*RUN, "hydra.run.dir=new", "train.resume=auto",
                                     "train.max_steps=1"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "train.resume=auto: no checkpoint and no privacy ledger in new, so the run starts " \
           "from step 0." in out


def test_resume_auto_in_the_folder_hydra_makes_for_the_command_is_refused_naming_the_last_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["train.max_steps=3"], tmp_path, monkeypatch, capsys)      # outputs/<date>/<time>
    (made,) = (tmp_path / "outputs").glob("*/*")
    earlier = tmp_path / "outputs" / "2026-01-01" / "09-00-00"          # as if started earlier
    earlier.parent.mkdir()
    made.rename(earlier)
    _dptrain(["train.max_steps=3", "optimizer.lr=0.1",                    # newer, another config
              "hydra.run.dir=outputs/2026-01-01/10-00-00"], tmp_path, monkeypatch, capsys)
    code, out, err = run_in_process([*RUN, "train.resume=auto"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert "train.resume=auto looks for a checkpoint in the run folder, but outputs/" in err
    assert "nothing to resume there. The newest run with this config is " \
           "outputs/2026-01-01/09-00-00; continue it with: dptrain " in err
    assert err.split("continue it with: ")[1].split("\n")[0].endswith(
        "hydra.run.dir=outputs/2026-01-01/09-00-00 train.resume=auto")


def test_resume_auto_with_no_earlier_run_of_the_config_is_refused_saying_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process([*RUN, "train.resume=auto"], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert "No earlier run with this config was found under outputs" in err


def test_resuming_over_a_changed_training_record_charges_the_replayed_steps_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "data" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    write_mnist(images.parent, n_train=32, n_test=4)         # 32 examples, q = 8 / 32: 4 steps
    run = ["+recipe=mnist_cnn", "dataset.root=data", "train.batch_size=8", "train.epochs=3",
           "hardware=cpu", "hydra.run.dir=run", "train.keep_checkpoints=null", *QUIET,
           "privacy.reproducible_mechanism=true"]     # the same noise and coins on a replay
    code, _, err = run_in_process(run, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    once = load_ledger(tmp_path / "run")
    data = bytearray(images.read_bytes())
    data[16 + 5 * 28 * 28 + 300] ^= 0xFF                    # one pixel of training example 5
    images.write_bytes(bytes(data))
    code, out, err = run_in_process([*run, "train.resume=run/checkpoints/epoch_1.pt"], tmp_path,
                                    monkeypatch, capsys)
    assert code == 0, err
    ledger = load_ledger(tmp_path / "run")
    every_step = [(1.1, 8 / 32, 3 * 4 + 2 * 4)]             # epochs 2 and 3 released twice
    assert history_from_json(ledger["history"]) == every_step
    assert ledger["epsilon"] == epsilon_of(every_step, ledger["delta"], "prv") > once["epsilon"]
    assert ledger["resumes"][-1]["charged_steps"] == 8
    assert len(set(ledger["dataset"]["fingerprints"])) == 2
    assert ("8 steps an earlier process took beyond it stay charged: the training data differ "
            "from the data they were computed on") in out


def test_resume_auto_from_a_damaged_last_checkpoint_names_the_newest_checkpoint_that_still_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run", "train.keep_checkpoints=null"], tmp_path, monkeypatch, capsys)
    last = tmp_path / "run" / "checkpoints" / "last.pt"    # a hard link to epoch_2.pt
    with last.open("r+b") as handle:                       # a disk fault: both damaged
        handle.seek(300)
        handle.write(b"\0" * 64)
    code, _, err = run_in_process([*RUN, "hydra.run.dir=run", "train.keep_checkpoints=null",
                                   "train.resume=auto"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert "run/checkpoints/last.pt' is corrupt" in err
    assert "epoch_2.pt is the same file (a hard link) and damaged with it" in err
    assert ("The newest checkpoint in run/checkpoints that still loads is "
            "run/checkpoints/epoch_1.pt (step 12, epoch 1): resume from it with "
            "train.resume=run/checkpoints/epoch_1.pt.") in " ".join(err.split())
