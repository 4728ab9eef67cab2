"""Benchmark datasets: the real datasets' sizes and shapes, filled with synthetic data.

Runtimes do not depend on pixel or token values, so each configuration trains on a small pool of
random batches with the real per-sample shape (``dptrain.models.input_spec``); an epoch has as
many steps as the real training set (``ceil(size / batch_size)``) unless shortened.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from _bench_hf import HF_DATASETS, HF_MODELS, build_hf_model, hf_batch
from dptrain.models import get_model, input_spec

#: Model name -> (dataset name, training-set size), as in the Opacus paper's Figure 2.
DATASETS: dict[str, tuple[str, int]] = {
    "mnist_cnn": ("MNIST", 60_000),
    "cifar10_cnn": ("CIFAR-10", 50_000),
    "imdb_embedding": ("IMDb", 25_000),
    "imdb_lstm": ("IMDb", 25_000),
    "digits_mlp": ("digits", 1_797),
    "resnet18": ("CIFAR-10", 50_000),
    "transformer": ("synthetic LM (T=256, vocab 32k)", 25_000),
    "one_layer": ("synthetic, 10 features, 2 classes", 6_400),  # the fixed per-step cost alone
    **HF_DATASETS,  # Hugging Face BERT-base / GPT-2-small shapes, full and LoRA (_bench_hf)
}

#: Constructor arguments of each benchmarked model (the transformer: a 6x512 GPT, T=256, vocab 32k).
MODEL_KWARGS: dict[str, dict] = {
    "transformer": {"vocab_size": 32_000, "seq_len": 256, "n_layer": 6, "n_embd": 512, "n_head": 8},
}

#: Input features of ``one_layer``: one nn.Linear(10, 2), whose step is almost all fixed cost
#: (hooks, clipping and noise book-keeping, optimizer), the overhead that dominates small models.
ONE_LAYER_FEATURES = 10

#: Distinct random batches cycled through during timing (enough to defeat any caching).
POOL_SIZE = 2


@dataclass(frozen=True)
class Workload:
    """The data side of one configuration: model name, batch size B and steps per epoch.

    Attributes:
        dataset_steps: steps of a real epoch, ``ceil(dataset_size / B)``.
        steps: steps timed per "epoch" (``dataset_steps`` unless shortened for CPU).
    """

    model: str
    batch_size: int
    dataset_steps: int
    steps: int

    @property
    def scale(self) -> float:
        """Factor turning the time of ``steps`` steps into a full-epoch estimate (>= 1)."""
        return self.dataset_steps / self.steps


def workload(model: str, batch_size: int, steps_per_epoch: int | None) -> Workload:
    """Steps of a real epoch for ``model`` at ``batch_size``, optionally capped at ``steps_per_epoch``."""
    size = DATASETS[model][1]
    dataset_steps = math.ceil(size / batch_size)
    steps = dataset_steps if steps_per_epoch is None else min(steps_per_epoch, dataset_steps)
    return Workload(model, batch_size, dataset_steps, steps)


def build_model(model: str, **overrides) -> nn.Module:
    """The benchmarked model ``model`` (``overrides``: e.g. ``layers`` of a Hugging Face model)."""
    if model in HF_MODELS:
        return build_hf_model(model, **overrides)
    if model == "one_layer":  # one nn.Linear(10, 2): almost no arithmetic, the per-step cost shows
        return nn.Linear(ONE_LAYER_FEATURES, 2)
    return get_model(model, **{**MODEL_KWARGS.get(model, {}), **overrides})


def batch_pool(
    model: str, batch_size: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``POOL_SIZE`` random (inputs ``[B, *shape]``, labels) batches on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    if model in HF_MODELS:
        return [hf_batch(model, batch_size, generator, device) for _ in range(POOL_SIZE)]
    if model == "one_layer":
        return [(torch.randn(batch_size, ONE_LAYER_FEATURES, generator=generator).to(device),
                 torch.randint(0, 2, (batch_size,), generator=generator).to(device))
                for _ in range(POOL_SIZE)]
    spec = input_spec(model, **MODEL_KWARGS.get(model, {}))
    return [spec.batch(batch_size, generator, device=device) for _ in range(POOL_SIZE)]
