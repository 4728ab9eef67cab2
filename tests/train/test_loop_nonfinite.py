"""A run whose training set holds an example with a NaN feature: the parameters stay finite, and
the number of examples left out of the clipped sums (a statistic of the training data) goes to
private_metrics.jsonl only, never to the public metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from test_trainer_support import N_TRAIN, final_weights, make_job, make_settings, tiny_data
from torch.utils.data import TensorDataset

from dptrain.train.loop import train


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _with_a_nan_feature(index: int = 7) -> TensorDataset:
    x, y = tiny_data()[0].tensors
    x = x.clone()
    x[index, 2] = math.nan
    return TensorDataset(x, y)


def test_the_count_of_nonfinite_examples_reaches_the_private_metrics_only(tmp_path):
    # q = 1: each epoch is one step whose batch holds every example, the NaN one included
    job = make_job(private=True, batch_size=N_TRAIN, train_set=_with_a_nan_feature())
    train(job, make_settings(tmp_path, epochs=2, batch_size=N_TRAIN))
    assert all(torch.isfinite(w).all() for w in final_weights(job).values())
    private = [r for r in _records(tmp_path / "private_metrics.jsonl") if "epoch" in r]
    assert [r["nonfinite_examples"] for r in private] == [1, 1]
    assert all("nonfinite_examples" not in r for r in _records(tmp_path / "metrics.jsonl"))


def test_a_run_without_nonfinite_examples_counts_none(tmp_path):
    train(make_job(private=True), make_settings(tmp_path, epochs=1))
    (record,) = [r for r in _records(tmp_path / "private_metrics.jsonl") if "epoch" in r]
    assert record["nonfinite_examples"] == 0
