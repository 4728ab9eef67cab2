"""Tiny jobs for the trainer, ledger, checkpoint, resume and crash tests (no tests here).

Everything is float64, a few dozen samples and a 2-layer MLP, so a full run takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptrain.train.job import PrivacySettings, TrainingJob, TrainSettings

N_TRAIN, N_TEST, N_VALIDATION, FEATURES, CLASSES = 48, 16, 16, 5, 3


def tiny_data(seed: int = 0) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Train/test/validation sets: x [N, 5] float64, labels [N] in {0, 1, 2} from a fixed linear
    rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_TEST, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, CLASSES, generator=g, dtype=torch.float64)
    y = (x @ w).argmax(dim=1)
    x_val = torch.randn(N_VALIDATION, FEATURES, generator=g, dtype=torch.float64)
    return (TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:]),
            TensorDataset(x_val, (x_val @ w).argmax(dim=1)))


def changed_record(index: int = 7) -> TensorDataset:
    """The training set of `tiny_data()` with one feature of example `index` changed (same N)."""
    x, y = tiny_data()[0].tensors
    x = x.clone()
    x[index, 0] += 1.0
    return TensorDataset(x, y)


def tiny_model(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(8, CLASSES)).double()


def tiny_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"model": {"name": "tiny_mlp"}, "dataset": {"name": "tiny"},
                              "optimizer": {"name": "sgd", "lr": 0.1},
                              "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
                              "train": {"epochs": 3, "batch_size": 12, "seed": 0,
                                        "resume": None, "max_steps": None}}
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return config


def make_job(private: bool = True, seed: int = 0, noise_multiplier: float = 1.0,
             target_epsilon: float | None = None, accountant: str = "rdp",
             batch_size: int = 12, dropout: float = 0.0, config: dict | None = None,
             loss_fn: Any = None, noise_schedule: dict | None = None,
             engine_kwargs: dict | None = None, secure: bool = False,
             validation: bool = False, reproducible_mechanism: bool = True,
             train_set: TensorDataset | None = None) -> TrainingJob:
    """A ready job; private ones go through dptrain.PrivacyEngine with seeded sampling and noise
    generators (`reproducible_mechanism`, so that two jobs compare bit for bit) unless
    `reproducible_mechanism=False` (the engine's default: both seeded from OS entropy) or
    `secure`.
    `validation` adds a validation loader (N_VALIDATION examples outside the training set);
    `train_set` replaces the N_TRAIN training examples (e.g. `changed_record()`)."""
    torch.manual_seed(seed)
    tiny_train, test_set, validation_set = tiny_data()
    train_set = tiny_train if train_set is None else train_set
    model = tiny_model(dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed + 1))
    test_loader = DataLoader(test_set, batch_size=8)
    engine = None
    q = batch_size / N_TRAIN
    if private:
        import dptrain

        seeded = reproducible_mechanism and not secure
        engine = dptrain.PrivacyEngine(accountant=accountant, secure_mode=secure, seed=seed + 3,
                                       reproducible_mechanism=seeded)
        noise = torch.Generator().manual_seed(seed + 2) if seeded else None
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=noise_multiplier, max_grad_norm=1.0, poisson_sampling=True,
            noise_generator=noise, **(engine_kwargs or {}))
    privacy = (PrivacySettings.of_engine(engine, target_epsilon=target_epsilon, target_delta=1e-5)
               if private else PrivacySettings(enabled=False))
    return TrainingJob(model=model, optimizer=optimizer, train_loader=loader,
                       test_loader=test_loader, loss_fn=loss_fn or nn.CrossEntropyLoss(),
                       device=torch.device("cpu"), engine=engine, privacy=privacy,
                       dataset_name="tiny", dataset_size=N_TRAIN,
                       config=config if config is not None else tiny_config(),
                       validation_loader=DataLoader(validation_set, batch_size=8)
                       if validation else None)


def make_settings(run_dir: Path, **overrides: Any) -> TrainSettings:
    values: dict[str, Any] = {"run_dir": Path(run_dir), "epochs": 3, "batch_size": 12,
                              "max_physical_batch_size": None, "seed": 0, "progress": False,
                              "keep_checkpoints": None}   # every epoch_N.pt: resumes go back
    values.update(overrides)
    return TrainSettings(**values)


def final_weights(job: TrainingJob) -> dict[str, torch.Tensor]:
    model = getattr(job.model, "_module", job.model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Killed(BaseException):
    """The process dies mid-run (an error, not Ctrl-C): its ledger says "failed"."""


def resume_after_a_crash_is_refused(tmp_path: Path, engine_kwargs: dict[str, Any],
                                    match: str) -> None:
    """A run of make_job(engine_kwargs) from OS entropy killed on its 6th training call leaves
    committed steps a new process would not replay exactly; its resume must raise ConfigError
    matching `match` and leave the ledger as it was."""
    from dptrain.errors import ConfigError
    from dptrain.train.loop import train

    job = make_job(engine_kwargs=engine_kwargs, reproducible_mechanism=False,
                   loss_fn=crash_at_call(6))
    with pytest.raises(Killed):
        train(job, make_settings(tmp_path, epochs=3))
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(ConfigError, match=match):
        train(make_job(engine_kwargs=engine_kwargs, reproducible_mechanism=False),
              make_settings(tmp_path, epochs=3, resume="auto"))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


def crash_at_call(n: int) -> Any:
    """A loss that raises Killed (a kill) on its n-th training call."""
    calls = {"n": 0}

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == n:
                raise Killed
        return torch.nn.functional.cross_entropy(out, y)

    return loss


def crash(run_dir: Path, at_call: int, **job_kwargs: Any) -> dict:
    """A 3-epoch run killed on its `at_call`-th training loss call; returns its ledger."""
    from dptrain.train.ledger import load_ledger
    from dptrain.train.loop import train

    with pytest.raises(Killed):
        train(make_job(loss_fn=crash_at_call(at_call), **job_kwargs),
              make_settings(run_dir, epochs=3))
    return load_ledger(run_dir)


def rewrite_history(run_dir: Path, steps: int | None = None, sigma: float | None = None) -> dict:
    """Edit `run_dir`'s ledger as a careful forger would: keep the first `steps` steps of its
    history (None: all), with noise multiplier `sigma` (None: as recorded), and recompute its
    counts and every epsilon it claims, so that the ledger alone verifies. Returns the new
    ledger."""
    import json
    import warnings

    from dptrain.train.ledger import (LEDGER_FILENAME, epsilon_of, history_from_json,
                                      history_steps, history_to_json, truncate_history)

    path = Path(run_dir) / LEDGER_FILENAME
    data = json.loads(path.read_text(encoding="utf-8"))
    history = history_from_json(data["history"])
    history = truncate_history(history, history_steps(history) if steps is None else steps)
    history = [(sigma or s, q, n) for s, q, n in history]
    data["history"] = history_to_json(history)
    data["steps_completed"], data["committed_ahead"] = history_steps(history), 0
    data["epsilon"] = epsilon_of(history, data["delta"], data["accountant"])
    with warnings.catch_warnings():   # gdp warns that it is an approximation
        warnings.simplefilter("ignore", UserWarning)
        for name, claim in data["epsilon_by_accountant"].items():
            claim["epsilon"] = epsilon_of(history, data["delta"], name)
    path.write_text(json.dumps(data), encoding="utf-8")
    return data
