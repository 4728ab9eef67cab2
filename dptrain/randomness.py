"""Randomness of the mechanism: Gaussian noise, uniform draws for sampling, and secure mode.

A module of its own, below `dptrain.privacy` (the noise) and `dptrain.data` (the Poisson sampler)
that both draw from it.

Every random number the DP mechanism uses (the gradient noise, the count noise of adaptive
clipping, the Poisson sampling coin flips) comes from this module, through `gaussian_noise` and
`uniform`. Three sources exist:

* **Unpredictable (the default)**: a `torch.Generator` seeded from the operating system's CSPRNG
  (`entropy_generator`), independent of every user-given seed, for the gradient noise and for the
  Poisson sampling coin flips alike. Nobody knows its seed, so neither the noise nor which
  examples each batch held can be rebuilt from the seed, the code or the ledger; its state is
  never written anywhere (checkpoints leave it out, and a resumed run draws a fresh seed), so a
  run is not reproducible bit for bit. The generator itself is torch's (Mersenne Twister on CPU,
  Philox on CUDA, 62-bit seeds), not a cryptographic one: an attacker who saw enough exact raw
  outputs could in principle recover its state, which is what secure mode closes.

* **Reproducible (opt-in, `reproducible_mechanism=True`)**: `torch.Generator`s seeded from a
  known seed (`make_generator`). The same seed gives the same run, bit for bit, which is what
  research needs. It is NOT a guarantee if the seed is known: anyone who knows the seed (or holds
  a checkpoint with the generators' states) can regenerate the noise and subtract it from the
  released model, and can tell which examples each batch held, which the accountants'
  amplification by subsampling assumes stays secret.

* **Secure mode** (`secure=True`): every draw reads fresh bytes from the operating system's
  CSPRNG (`os.urandom`, i.e. getrandom(2)/ChaCha20 on Linux), with no torch generator involved:

  - uniforms: 53 random bits per float64, mapped to the open interval (0, 1) (never 0 or 1);
  - Gaussians: Box-Muller on those uniforms in float64, and, as the defence against
    floating-point attacks on Gaussian sampling (Jin et al. 2022, "Are we there yet? Timing and
    floating-point attacks on differential privacy systems", arXiv:2112.05307; fix after Holohan
    and Braghin 2021, "Secure random sampling in differential privacy", arXiv:2107.10138), each
    output is the sum of `SECURE_GAUSSIAN_TERMS` = 4 independent standard normals divided by 2
    (again exactly N(0, 1) in real arithmetic). This is the mitigation Opacus also uses: it fills
    the gaps in the set of floats a single Box-Muller draw can produce, which the attack uses to
    tell neighbouring inputs apart from one output. It is a practical mitigation, not a proof.

  What secure mode protects: the noise and the sampling cannot be predicted or replayed from the
  seed, the code, other outputs or a checkpoint (generator states are not saved; nothing is).
  What it does NOT protect: (1) the noise is computed in float64 and then cast to the parameter's
  dtype and added in that dtype (float32/bf16): the final rounding is not a proven-exact
  discrete mechanism (Canonne-Kamath-Steinke discrete Gaussians would be needed for that);
  (2) timing side channels (the running time does not depend on the data through this module,
  but the training loop's does, e.g. through the batch size); (3) the model, optimizer, data and
  host themselves; (4) runs are not reproducible, by design.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

#: Standard normals summed (then divided by sqrt(terms)) per secure Gaussian output.
SECURE_GAUSSIAN_TERMS = 4

_MANTISSA_BITS = 53


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed` (reproducible, not secure)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) & (2**63 - 1))
    return generator


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded from the OS CSPRNG (unpredictable, not
    reproducible)."""
    return make_generator(secure_seed(), device)


def derive_seeds(seed: int, count: int) -> list[int]:
    """`count` independent child seeds (63-bit ints) derived from one parent seed."""
    parent = make_generator(seed)
    children = torch.randint(0, 2**62, (count,), generator=parent, dtype=torch.int64)
    return [int(c) for c in children.tolist()]


def secure_seed() -> int:
    """A 62-bit seed from the OS CSPRNG (for runs that need a fresh, unpredictable seed)."""
    return int.from_bytes(os.urandom(8), "little") >> 2


def _secure_uniform(numel: int) -> Tensor:
    """`numel` float64 uniforms in the open interval (0, 1), from os.urandom (53 bits each)."""
    if numel == 0:
        return torch.empty(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(os.urandom(8 * numel)), dtype=torch.int64)
    uniforms = words.bitwise_and_((1 << _MANTISSA_BITS) - 1).to(torch.float64)  # low 53 bits
    return uniforms.add_(0.5).mul_(2.0 ** -_MANTISSA_BITS)


def _secure_standard_normal(numel: int) -> Tensor:
    """`numel` float64 N(0, 1) draws by Box-Muller from CSPRNG uniforms (no defence yet)."""
    pairs = (numel + 1) // 2
    u = _secure_uniform(2 * pairs).view(2, pairs)
    radius = u[0].log_().mul_(-2.0).sqrt_()
    angle = u[1].mul_(2.0 * math.pi)
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:numel]


def secure_standard_normal(numel: int) -> Tensor:
    """`numel` float64 N(0, 1) draws from the OS CSPRNG, hardened against floating-point attacks.

    Each output is the sum of `SECURE_GAUSSIAN_TERMS` independent standard normals divided by
    sqrt(SECURE_GAUSSIAN_TERMS), which is again exactly N(0, 1).
    """
    terms = _secure_standard_normal(SECURE_GAUSSIAN_TERMS * numel).view(SECURE_GAUSSIAN_TERMS, numel)
    return terms.sum(dim=0) / math.sqrt(SECURE_GAUSSIAN_TERMS)


def _noise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype noise is drawn in: float64 for float64 targets, float32 otherwise (bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gaussian_noise(shape: Sequence[int] | torch.Size, std: float,
                   generator: torch.Generator | None, secure: bool, *,
                   device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """Gaussian noise N(0, std^2) of `shape`, on `device` with `dtype`.

    Args:
        shape: the output shape (e.g. a parameter's shape).
        std: standard deviation, in the units of the output (e.g. sigma * C, gradient units).
        generator: the seeded torch.Generator of the reproducible mode; ignored when `secure`.
        secure: draw from the OS CSPRNG with the floating-point defence (see module docstring).
        device: where the result lives (default: the generator's device, or CPU).
        dtype: the result's dtype; the draw is made in float64 (float64 targets, secure mode) or
            float32 and cast.

    Returns:
        Tensor[*shape]; all zeros (no randomness consumed) when std == 0.
    """
    shape = torch.Size(shape)
    if device is None:
        device = generator.device if generator is not None and not secure else "cpu"
    if std == 0:
        return torch.zeros(shape, device=device, dtype=dtype)
    if secure:
        draw = secure_standard_normal(shape.numel()).view(shape) * float(std)
        return draw.to(device=device, dtype=dtype)
    gen_device = generator.device if generator is not None else torch.device(device)
    draw = torch.normal(0.0, float(std), size=shape, generator=generator,
                        device=gen_device, dtype=_noise_dtype(dtype))
    return draw.to(device=device, dtype=dtype)


def uniform(numel: int, generator: torch.Generator | None, secure: bool) -> Tensor:
    """`numel` float64 uniforms in [0, 1) on CPU (open (0, 1) in secure mode).

    Used for Poisson sampling: example i joins the batch iff uniform[i] < q.
    """
    if secure:
        return _secure_uniform(numel)
    return torch.rand(numel, generator=generator, dtype=torch.float64)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and python's `random` (model initialisation, data
    order; never the mechanism's generators, seeded above)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
