"""Checkpoint files: atomic, integrity-checked, refused when corrupt or from another config."""

from __future__ import annotations

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


def test_bit_flipped_checkpoint_is_refused_by_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(path, _state(tiny_config()))
    envelope = torch.load(path, weights_only=False)
    payload = bytearray(envelope["payload"])
    payload[len(payload) // 2] ^= 0xFF
    envelope["payload"] = bytes(payload)
    torch.save(envelope, path)
    with pytest.raises(ConfigError, match="SHA-256"):
        ckpt.load_checkpoint(path)


def test_missing_checkpoint_names_train_resume(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.resume"):
        ckpt.load_checkpoint(tmp_path / "nope.pt")


def test_a_plain_torch_file_is_not_accepted_as_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ConfigError, match="not a dptrain checkpoint"):
        ckpt.load_checkpoint(tmp_path / "plain.pt")


def test_config_mismatch_names_the_differing_keys() -> None:
    state = _state(tiny_config())
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
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
