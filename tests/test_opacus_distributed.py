"""dptrain.opacus's distributed names (Opacus's DPDDP tutorial and FSDP example use them):
`GradSampleModule` from the top-level package, `optimizers.DistributedDPOptimizer` with Opacus's
per-rank expected batch size, `utils.fsdp_utils.FSDP2Wrapper` and grad_sample_mode="ghost_fsdp".
The multi-rank cases run on 2 forked gloo ranks (tests/distributed/ddp_workers.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed.ddp_workers import init_gloo, run_ranks

FEATURES, CLASSES, PER_RANK = 5, 3, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """2 * PER_RANK float64 examples (x, y), the same in every process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * PER_RANK, FEATURES, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (2 * PER_RANK,), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, CLASSES)).double()


def test_top_level_grad_sample_module_is_found_by_a_hand_built_dp_optimizer():
    from dptrain.opacus import GradSampleModule
    from dptrain.opacus.optimizers import DPOptimizer

    model = GradSampleModule(_model())
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=4)
    assert optimizer.module is model


def _distributed_optimizer_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Opacus's sync-chapter setup: DPDDP(GradSampleModule(model)), DistributedDPOptimizer with
    the per-rank expected batch, sigma 0, a bound no example reaches; rank r's PER_RANK examples."""
    from dptrain.opacus import GradSampleModule
    from dptrain.opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from dptrain.opacus.optimizers import DistributedDPOptimizer

    init_gloo(rank, world_size, port)
    model = DPDDP(GradSampleModule(_model()))
    optimizer = DistributedDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       noise_multiplier=0.0, max_grad_norm=1e6,
                                       expected_batch_size=PER_RANK)
    x, y = _data()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    optimizer.step()
    return {"grads": [p.grad.clone() for p in model.parameters()]}


def test_distributed_dp_optimizer_averages_the_ranks_gradients_with_opacus_expected_batch(tmp_path):
    ranks = run_ranks(_distributed_optimizer_worker, tmp_path)
    model, (x, y) = _model(), _data()
    nn.functional.cross_entropy(model(x), y).backward()  # the mean over both ranks' examples
    for result in ranks:
        for grad, p in zip(result["grads"], model.parameters()):
            torch.testing.assert_close(grad, p.grad)


def _fsdp_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """FSDP2Wrapper, then make_private(grad_sample_mode="ghost_fsdp") and one step at sigma 0."""
    from torch.distributed.fsdp import FSDPModule

    from dptrain.opacus import PrivacyEngine
    from dptrain.opacus.utils.fsdp_utils import FSDP2Wrapper

    init_gloo(rank, world_size, port)
    model = FSDP2Wrapper(_model())
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    module, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=0.0,
        max_grad_norm=1.0, grad_sample_mode="ghost_fsdp", poisson_sampling=True)
    for batch_x, batch_y in loader:
        optimizer.zero_grad()
        criterion(module(batch_x), batch_y).backward()
        optimizer.step()
        break
    return {"units": units, "optimizer": type(optimizer).__name__,
            "placements": {str(p.placements) for p in model.parameters()}}


def test_fsdp2_wrapper_shards_each_layer_and_ghost_fsdp_trains_it_sharded(tmp_path):
    for result in run_ranks(_fsdp_worker, tmp_path):
        assert result["units"] == ["", "0", "2"]  # the root and each Linear (Tanh: no parameters)
        assert result["placements"] == {"(Shard(dim=0),)"}
        assert result["optimizer"] == "ShardedDPOptimizer"


def test_ghost_fsdp_mode_is_the_ghost_clipping_module():
    from dptrain.opacus.grad_sample import GradSampleModuleFastGradientClipping
    from dptrain.opacus.grad_sample.utils import get_gsm_class

    assert get_gsm_class("ghost_fsdp") is GradSampleModuleFastGradientClipping


def test_make_private_accepts_ghost_fsdp_on_one_process_and_returns_the_criterion():
    from dptrain.opacus import PrivacyEngine

    model, (x, y) = _model(), _data()
    returned = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost_fsdp")
    assert len(returned) == 4


def test_dp_data_loader_from_data_loader_is_an_instance_of_opacus_dp_data_loader():
    from dptrain.opacus.data_loader import DPDataLoader

    x, y = _data()
    loader = DPDataLoader.from_data_loader(DataLoader(TensorDataset(x, y), batch_size=4))
    assert isinstance(loader, DPDataLoader)  # Opacus's Lightning example keys Poisson on this
