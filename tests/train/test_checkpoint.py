"""Checkpoint files: atomic, integrity-checked, refused when corrupt or from another config, and
never able to run code when they are loaded."""

from __future__ import annotations

import hashlib
import io
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer_support import make_job, make_settings, tiny_config, tiny_data

from dptrain.data.fingerprint import data_fingerprint
from dptrain.train import checkpoint as ckpt
from dptrain.train.ledger import config_hash
from dptrain.train.loop import train
from dptrain.train.settings import command_line_names
from dptrain.errors import ConfigError


def _state(config: dict) -> dict:
    return {"step": 3, "epoch": 1, "config": config, "config_hash": config_hash(config),
            "model": {"w": torch.arange(6.0, dtype=torch.float64)}, "optimizer": {},
            "rng": ckpt.capture_rng_state(), "generators": {}}


def test_saved_checkpoint_loads_back_equal(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path / "c.pt", _state(tiny_config()))
    loaded = ckpt.load_checkpoint(tmp_path / "c.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(6.0).double())


def test_truncated_checkpoint_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, _state(tiny_config()))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        ckpt.load_checkpoint(path)


def test_bit_flipped_checkpoint_is_refused_by_its_digest_before_anything_is_unpickled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, _state(tiny_config()))
    data = bytearray(path.read_bytes())
    data[-len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: unpickled.append(args))
    with pytest.raises(ConfigError, match="SHA-256"):
        ckpt.load_checkpoint(path)
    assert unpickled == []


def test_missing_checkpoint_names_the_resume_argument_from_python(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"TrainSettings\.resume"):
        ckpt.load_checkpoint(tmp_path / "nope.pt")


def test_missing_checkpoint_names_train_resume_under_the_command(tmp_path: Path) -> None:
    with command_line_names(), pytest.raises(ConfigError, match=r"\(train\.resume\)"):
        ckpt.load_checkpoint(tmp_path / "nope.pt")


def test_a_plain_torch_file_is_not_accepted_as_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ConfigError, match="not a dptrain checkpoint"):
        ckpt.load_checkpoint(tmp_path / "plain.pt")


def test_a_file_that_is_not_a_checkpoint_is_refused_in_one_paragraph_naming_its_path(
        tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint\n")
    with pytest.raises(ConfigError) as refused:
        ckpt.load_checkpoint(path)
    assert str(path) in str(refused.value) and "not a dptrain checkpoint" in str(refused.value)
    assert "\n" not in str(refused.value)


# ----------------------------------------------------------------------------- no code runs
class _WritesMarker:
    """Unpickled, it creates the file `marker` (what a crafted file could do with any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _version_1_file(payload: bytes, **extra: object) -> bytes:
    """A file in the format dptrain wrote before version 2: a torch.save envelope."""
    return _torch_bytes({"format": ckpt.CHECKPOINT_FORMAT, "version": 1,
                         "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload,
                         **extra})


def _version_2_file(payload: bytes) -> bytes:
    header = ckpt.HEADER.pack(2, hashlib.sha256(payload).digest(), len(payload))
    return ckpt.MAGIC + header + payload


def _evil_state(marker: Path) -> bytes:
    return _torch_bytes({**_state(tiny_config()), "model": _WritesMarker(marker)})


# Checkpoint-like files whose unpickling would create `marker`, each with a valid digest.
CRAFTED = {
    "version 2, in the payload": lambda marker: _version_2_file(_evil_state(marker)),
    "version 1, in the payload": lambda marker: _version_1_file(_evil_state(marker)),
    "version 1, in the envelope": lambda marker: _version_1_file(
        _torch_bytes(_state(tiny_config())), note=_WritesMarker(marker)),
    "a bare pickle": lambda marker: pickle.dumps(_WritesMarker(marker), protocol=2),
}


@pytest.mark.parametrize("form", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path: Path,
                                                                   form: str) -> None:
    marker = tmp_path / "code_ran"
    path = tmp_path / "checkpoints" / "last.pt"
    path.parent.mkdir()
    path.write_bytes(CRAFTED[form](marker))
    with pytest.raises(ConfigError, match="tensors and plain data") as refused:
        ckpt.load_checkpoint(path)
    assert not marker.exists()
    assert str(path) in str(refused.value)


def test_a_real_checkpoint_payload_loads_with_weights_only(tmp_path: Path) -> None:
    train(make_job(private=True), make_settings(tmp_path, epochs=1))
    data = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    assert data.startswith(ckpt.MAGIC)
    payload = data[len(ckpt.MAGIC) + ckpt.HEADER.size:]
    state = torch.load(io.BytesIO(payload), weights_only=True)
    assert state["step"] == 4 and state["engine"] is not None and state["generators"]
    assert ckpt.load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 4


def test_a_version_1_checkpoint_of_tensors_and_plain_data_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    path.write_bytes(_version_1_file(_torch_bytes(_state(tiny_config()))))
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.arange(6.0).double())


# ----------------------------------------------------------------------------- damaged last.pt
def _damage(path: Path) -> None:
    """Overwrite `path` in place (its hard links see the same bytes), as a disk fault would."""
    with path.open("r+b") as handle:
        handle.seek(200)
        handle.write(b"\0" * 64)


def test_a_damaged_last_checkpoint_names_the_newest_one_that_still_loads(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=2))
    folder = tmp_path / "checkpoints"
    _damage(folder / "last.pt")                      # epoch_2.pt is the same file
    with command_line_names(), pytest.raises(ConfigError) as refused:
        ckpt.load_checkpoint(folder / "last.pt")
    message = str(refused.value)
    assert "epoch_2.pt is the same file (a hard link) and damaged with it" in message
    assert (f"The newest checkpoint in {folder} that still loads is {folder / 'epoch_1.pt'} "
            f"(step 4, epoch 1): resume from it with train.resume={folder / 'epoch_1.pt'}."
            ) in message


def test_a_damaged_only_checkpoint_says_that_none_still_loads(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=1))
    folder = tmp_path / "checkpoints"
    _damage(folder / "last.pt")
    with pytest.raises(ConfigError, match=f"No other checkpoint in {folder} loads"):
        ckpt.load_checkpoint(folder / "last.pt")


def test_config_mismatch_names_the_differing_keys() -> None:
    state = _state(tiny_config())
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        ckpt.check_same_config(state, tiny_config(**{"optimizer.lr": 0.5}), "c.pt")


def test_config_mismatch_shows_the_recorded_and_the_new_value_of_each_key() -> None:
    state = _state(tiny_config())
    lr = tiny_config()["optimizer"]["lr"]
    with pytest.raises(ConfigError, match=rf"optimizer\.lr \(recorded {lr!r}, now 0\.5\)"):
        ckpt.check_same_config(state, tiny_config(**{"optimizer.lr": 0.5}), "c.pt")


def test_resume_exempt_keys_do_not_change_the_config_hash() -> None:
    base = tiny_config()
    changed = tiny_config(**{"train.resume": "auto", "train.max_steps": 7})
    assert config_hash(base) == config_hash(changed)


def test_rng_state_roundtrip_replays_the_same_draws() -> None:
    state = ckpt.capture_rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.restore_rng_state(state)
    second = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert first[2] == second[2]


def test_find_generators_reaches_the_loader_generator() -> None:
    gen = torch.Generator()
    loader = torch.utils.data.DataLoader(list(range(4)), shuffle=True, generator=gen)
    found = ckpt.find_generators(loader, "loader")
    assert any(g is gen for g in found.values())


def test_latest_checkpoint_is_the_newest_file(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=2))
    assert ckpt.latest_checkpoint(tmp_path).name == "last.pt"


def test_resume_from_a_corrupt_checkpoint_fails_and_changes_nothing(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=2))
    last = tmp_path / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:100])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        train(make_job(private=False), make_settings(tmp_path, epochs=3, resume=str(last)))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resume_with_a_different_config_is_refused(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=1))
    other = make_job(private=False, config=tiny_config(**{"optimizer.lr": 0.5}))
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        train(other, make_settings(tmp_path, epochs=2, resume="auto"))


def test_a_checkpoint_records_the_fingerprint_of_the_training_data(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=1))
    state = ckpt.load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["data_fingerprint"] == data_fingerprint(tiny_data()[0])
