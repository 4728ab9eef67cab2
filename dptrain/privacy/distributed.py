"""DistributedDPOptimizer: the DP-SGD step of one logical batch spread over W processes.

Each rank clips the per-sample gradients of ITS shard of the logical batch (any per-sample
gradient mode, any number of physical chunks: `clip_and_accumulate` is unchanged), then at the
reduction point `_combine_clipped_sums` ONE all-reduce (sum) gives every rank

    S = sum over ranks of the clipped sums            (the global clipped sum)
    Z = the noise drawn by rank 0 alone, N(0, (sigma * C / (q * N))^2) per coordinate
        (the noise of the sum, already divided by the expected batch size q * N),

packed into one flat buffer. The base class then writes p.grad = Z + S / (q * N) on every rank.

Why this design:
* Noise is drawn exactly once per logical step, by rank 0, from the engine's noise generator (or
  the OS CSPRNG in secure mode): its std is sigma * C, not sqrt(W) * sigma * C (every rank
  drawing its own full noise) and never missing. The other ranks contribute zeros to Z.
* Every rank receives the same S + Z bit for bit (one collective), so the models stay identical
  without broadcasting parameters, and the noise stream is the one a single-process run would
  draw: with the same seed, a W-process run reproduces the single-process run.
* `p.summed_grad` holds the noiseless global sum S, as on one process.
* Secure mode keeps working: rank 0's CSPRNG draw reaches the others through the all-reduce
  (splitting the noise as W draws of std sigma*C/sqrt(W) would need W independent sources and
  leave each rank knowing part of the noise).
Cost: the all-reduce carries 2x the parameters (S and Z) when sigma > 0, 1x when sigma = 0.

Adaptive clipping: the unclipped counts of the ranks are summed in the same all-reduce, and the
count noise is drawn by rank 0 and shared (a one-number all-reduce), so the bound stays equal on
every rank. So are the examples each rank left out for a non-finite gradient
(`DPOptimizer.excluded_examples`, for the private metrics).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain.distributed.consistency import check_same_on_every_rank
from dptrain.distributed.fsdp import ShardNoise, as_sharded, local_rows, reduce_scatter_rows
from dptrain.distributed.runtime import get_rank, get_world_size
from dptrain.grad_sample.ghost_math import norm_dtype
from dptrain.privacy.optimizer import DPOptimizer
from dptrain.randomness import gaussian_noise


def _flat_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """float64 when any parameter is float64, else float32 (the noise dtypes of DPOptimizer)."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def mechanism_summary(optimizer: DPOptimizer) -> dict[str, Any]:
    """What every rank's DP optimizer must agree on: sigma, q, the expected batch size, secure
    mode, the clipper's scalar settings (per-layer bounds included), the noise strategy and the
    parameter shapes."""
    clipper = optimizer.clipper
    settings = {k: v for k, v in vars(clipper).items() if isinstance(v, (bool, int, float, str))}
    bounds = getattr(clipper, "bounds", None)  # per-layer: {p: C_k}
    per_layer = [float(b) for b in bounds.values()] if isinstance(bounds, dict) else None
    return {"noise_multiplier": optimizer.noise_multiplier, "sample_rate": optimizer.sample_rate,
            "expected_batch_size": optimizer.expected_batch_size,
            "secure_mode": optimizer.secure_mode,
            "clipping": clipper.name, "max_grad_norm": clipper.max_grad_norm,
            "clipper": settings,
            "per_layer_bounds": per_layer,
            "noise_strategy": optimizer.noise_strategy.to_dict(),
            "parameters": [[list(p.shape), str(p.dtype)] for p in optimizer.params]}


class DistributedDPOptimizer(DPOptimizer):
    """A DPOptimizer whose clipped sums are all-reduced across `group` before the noise.

    Args: as `DPOptimizer`, plus `group`: the process group (default: the world; DDP's
    `process_group` when made private from a DDP model). Every rank must call `step()` once per
    logical batch (virtual-batch chunks are local and may differ in number across ranks).

    Construction is a collective: the ranks check that they apply the same mechanism
    (`mechanism_summary`), since rank 0's noise is calibrated to rank 0's clipping norm and
    sigma; a rank clipping at a larger norm would leak, a rank with another model would hang.
    """

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        self.group = group
        self.rank = get_rank(group)
        self.world_size = get_world_size(group)
        self._pending_noise: dict[nn.Parameter, Tensor] = {}
        super().__init__(*args, **kwargs)
        check_same_on_every_rank(
            mechanism_summary(self), "the DP optimizer (make_private's arguments)",
            "every rank must call make_private with the same model, noise_multiplier, "
            "max_grad_norm, clipping options and loader batch size: the noise drawn once by rank "
            "0 covers the clipping of every rank only if they are equal.", group=group)

    def _gradient_noise_std(self) -> float:
        """sigma_grad * C: the std of the gradient noise, in gradient units (as DPOptimizer)."""
        return self.clipper.gradient_noise_multiplier(self.noise_multiplier) * self.clipper.max_grad_norm

    def _all_reduce(self, flat: Tensor) -> Tensor:
        """Sum `flat` over the ranks of the group, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        return flat

    def _step_counts(self, device: torch.device) -> Tensor:
        """This rank's counts of the step, summed over the ranks with its clipped sums:
        Tensor[1 or 2] float64, the examples excluded for a non-finite gradient, then adaptive
        clipping's centred unclipped count (adaptive only)."""
        counts = [torch.as_tensor(self.excluded_examples, dtype=torch.float64, device=device)]
        if hasattr(self.clipper, "centred_count"):
            counts.append(torch.tensor(float(self.clipper.centred_count), dtype=torch.float64,
                                       device=device))
        return torch.stack(counts)

    def _take_step_counts(self, summed: Tensor) -> None:
        """Keep the counts of every rank (`_step_counts` summed over the ranks); the excluded
        examples stay a tensor (a copy: a view would keep the all-reduced buffer alive)."""
        self.excluded_examples = summed[0].round().to(torch.int64)
        if hasattr(self.clipper, "centred_count"):
            self.clipper.centred_count = float(summed[1])

    def _combine_clipped_sums(self, sums: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """All-reduce the clipped sums {p: Tensor[*p.shape]} with rank 0's noise (see module doc).

        Returns the global clipped sums; the global noise, drawn at the std of the base class's
        `_write_noisy_gradients` (divided by the expected batch size), waits in `_pending_noise`
        for `_noise`.
        """
        params = list(sums)
        std = self._gradient_noise_std() / self.expected_batch_size
        pieces = [sums[p].reshape(-1) for p in params]
        if std > 0:
            noises = [super(DistributedDPOptimizer, self)._noise(p, std) if self.rank == 0
                      else torch.zeros_like(p, dtype=_flat_dtype([p])) for p in params]
            pieces += [n.reshape(-1) for n in noises]
        device = params[0].device if params else torch.device("cpu")
        counts = self._step_counts(device)  # summed in the same all-reduce
        dtype = _flat_dtype(params)
        flat = self._all_reduce(torch.cat([t.to(dtype) for t in [*pieces, counts]]))
        self._take_step_counts(flat[flat.numel() - counts.numel():])
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        combined = {p: c.view_as(p).to(norm_dtype(p)) for p, c in zip(params, flat[:total].split(sizes))}
        self._pending_noise = ({p: c.view(p.shape) for p, c in
                                zip(params, flat[total:2 * total].split(sizes))} if std > 0 else {})
        return combined

    def _noise(self, p: nn.Parameter, std: float) -> Tensor:
        """The global noise of `p` from the last all-reduce (zeros when std == 0), a fresh tensor
        (not a view of the all-reduced buffer, which p.grad would otherwise keep alive)."""
        noise = self._pending_noise.pop(p, None)
        if noise is None:
            dtype = _flat_dtype([p])
            return torch.zeros(p.shape, dtype=dtype, device=p.device)
        return noise.clone()

    def _scalar_noise(self, std: float) -> float:
        """One N(0, std^2) draw by rank 0, shared with every rank (adaptive clipping's count)."""
        value = super()._scalar_noise(std) if self.rank == 0 else 0.0
        device = self.params[0].device if self.params else torch.device("cpu")
        return float(self._all_reduce(torch.tensor([value], dtype=torch.float64, device=device))[0])


class ShardedDPOptimizer(DistributedDPOptimizer):
    """The DP step of a fully sharded (FSDP2) model: clipped sums reduce-scattered to the shards,
    each rank noising only its own rows (see dptrain/distributed/fsdp.py).

    The optimizer holds the sharded parameters (DTensors). Each rank's clipped sums are full-size
    ({p: Tensor[*p.shape]}, its examples only); `_combine_clipped_sums` reduce-scatters each (one
    collective per parameter: the global clipped sum of this rank's rows, never the whole sum on
    one rank), and `_noise` draws N(0, std^2) for this rank's rows alone from this rank's stream
    (`ShardNoise`): every element is noised once per step, by the rank holding it, with the std of
    the base class, and the ranks' draws are independent. Adaptive clipping's count (and the count
    of excluded examples) is summed and its noise shared as in `DistributedDPOptimizer`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shard_noise = ShardNoise(self.rank, self.world_size)
        self._step_generator: torch.Generator | None = None

    def passes_on_every_rank(self, local: int) -> int:
        """The number of forward/backward passes every rank runs this step, given this rank's
        `local` count: the largest over the ranks (a collective). FSDP gathers each unit's
        parameters in every pass, a collective, so the ranks must run as many passes."""
        device = self.params[0].device if self.params else torch.device("cpu")
        count = torch.tensor([local], dtype=torch.int64, device=device)
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count[0])

    def _combine_clipped_sums(self, sums: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """{p: DTensor} of the global clipped sums of this rank's rows (see the class doc)."""
        combined = {}
        for p, local in sums.items():
            full = (torch.zeros(p.shape, dtype=norm_dtype(p), device=p.device)
                    if _is_distributed_tensor(local) else local)
            combined[p] = as_sharded(p, reduce_scatter_rows(full, p).to(norm_dtype(p)))
        device = self.params[0].device if self.params else torch.device("cpu")
        self._take_step_counts(self._all_reduce(self._step_counts(device)))
        self._step_generator = self._shard_noise.next_generator(self.noise_generator)
        return combined

    def _noise(self, p: nn.Parameter, std: float) -> Tensor:
        """N(0, std^2) for this rank's rows of `p` (a DTensor laid out like p; zeros at std 0)."""
        local = local_rows(p)
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        if std == 0:
            return as_sharded(p, torch.zeros(local.shape, dtype=dtype, device=local.device))
        return as_sharded(p, gaussian_noise(local.shape, std, self._step_generator,
                                            self.secure_mode, device=local.device, dtype=dtype))


def _is_distributed_tensor(t: Tensor) -> bool:
    """Whether `t` is a DTensor (a sharded parameter's placeholder zeros, not a clipped sum)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
