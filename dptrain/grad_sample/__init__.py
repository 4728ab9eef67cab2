"""Per-sample gradients: GradSampleModule, the sampler registry, built-in samplers.

Importing this package registers the built-in samplers (Linear, Conv, Embedding, norms, the
rule of the DP layers' own piece ``SequenceBias``: ``sequence_bias``, and the Hugging Face layers
by class name: ``hf_layers`` and the mixture-of-experts layers ``hf_moe``, which do not import
transformers).
"""

from dptrain.grad_sample import conv, embedding, linear, norms, sequence_bias  # noqa: F401
from dptrain.grad_sample import hf_layers, hf_moe  # noqa: F401  (registration, after linear/norms)
from dptrain.grad_sample.check import check_per_sample_gradients
from dptrain.grad_sample.module import GradSampleModule
from dptrain.grad_sample.registry import (
    get_grad_sampler,
    get_norm_sampler,
    register_grad_sampler,
    register_norm_sampler,
)

__all__ = [
    "GradSampleModule",
    "check_per_sample_gradients",
    "get_grad_sampler",
    "get_norm_sampler",
    "register_grad_sampler",
    "register_norm_sampler",
]

