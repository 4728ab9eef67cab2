"""An example with a NaN feature on one of 2 gloo ranks (DDP, hooks and ghost; FSDP2, hooks):
the parameters stay finite and equal to the single-process run's, and every rank holds the
global count of examples left out (summed with the clipped sums), for the private metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_workers
import fsdp_workers
from ddp_workers import N, SEED, init_gloo

BAD = 3   # rank 1's shard holds it (rank-strided shards)
SCENARIOS = {"ddp_hooks": ("ddp", "hooks"), "ddp_ghost": ("ddp", "ghost"),
             "fsdp_hooks": ("fsdp", "hooks")}


def _nan_problem() -> tuple[nn.Module, TensorDataset]:
    model, data = ddp_workers.make_problem()
    x, y = data.tensors
    x = x.clone()
    x[BAD, 1] = math.nan
    return model, TensorDataset(x, y)


def train_with_a_nan_example(kind: str | None, mode: str, epochs: int = 2) -> dict[str, Any]:
    """`epochs` steps at q = 1 (each batch holds the NaN example), sigma 0; `kind`: "ddp",
    "fsdp" or None (one process). The final parameters and each step's excluded count."""
    from dptrain.privacy.engine import PrivacyEngine

    model, data = _nan_problem()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp":
        model = fsdp_workers._shard(model, fsdp_workers.no_units)
    engine = PrivacyEngine(accountant="rdp", seed=SEED, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=N), noise_multiplier=0.0, max_grad_norm=0.3,
        grad_sample_mode=mode)
    counts: list[int] = []
    optimizer.attach_step_hook(lambda opt: counts.append(int(opt.excluded_examples)))
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
    return {"params": fsdp_workers.full_parameters(model), "counts": counts}


def _worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    init_gloo(rank, world_size, port)
    return {name: train_with_a_nan_example(kind, mode) for name, (kind, mode) in SCENARIOS.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    results = ddp_workers.run_ranks(_worker, tmp_path_factory.mktemp("nonfinite"), timeout_s=240)
    for result in results:
        assert "crash" not in result, result.get("crash")
    return results


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_nan_example_on_one_rank_leaves_every_ranks_model_finite_and_equal_to_one_process(
        ranks, scenario):
    single = train_with_a_nan_example(None, SCENARIOS[scenario][1])
    assert torch.isfinite(single["params"]).all()
    for result in ranks:
        torch.testing.assert_close(result[scenario]["params"], single["params"], rtol=0, atol=1e-12)
        assert result[scenario]["counts"] == single["counts"] == [1, 1]
