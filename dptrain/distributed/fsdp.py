"""Fully sharded models (FSDP2, `torch.distributed.fsdp.fully_shard`) in `make_private`.

`PrivacyEngine.make_private(module=model, ...)` with a model sharded by `fully_shard` (one unit per
transformer block and one for the root, the usual layout) trains privately across the ranks of
its mesh. What each rank holds and computes:

* Parameters: FSDP registers the SHARDED parameters (DTensors, `Shard(0)`: rank r holds rows
  `chunk(W)[r]` of every parameter) on the modules between forward passes, and gathers a unit's
  full ("unsharded") parameters only while that unit runs its forward or backward. The optimizer
  and its state see only the shards.
* Per-sample work: each rank runs ITS examples (its shard of the Poisson batch) through the
  gathered parameters, so the per-sample gradients (hooks) or their norms (ghost) a layer's hooks
  compute are over the FULL parameter, for this rank's examples. An example's norm over all of its
  parameters is therefore exact on the rank that holds the example: no norm term needs a
  cross-rank reduction. The hooks are put on the gathered parameter objects (FSDP keeps one per
  parameter and reuses it), which `ShardMap` finds; `ShardedPerSampleModule` presents them to the
  clipper and the optimizer under the sharded parameters' names.
* Clipped sum: each rank sums its clipped examples into a full-size buffer per parameter (float32
  for 16-bit parameters, as on one process); at the step, ONE reduce-scatter per parameter sums
  the ranks' buffers and leaves each rank its own rows (`reduce_scatter_rows`).
* Noise: each rank draws the noise of ITS rows only, from its own stream (`ShardNoise`): every
  parameter element gets noise exactly once per step with std sigma*C (divided by the expected
  batch size), and the ranks' draws are independent (a seeded run derives one seed per rank and
  step from the engine's generator; an unseeded run uses each rank's own OS-entropy generator).

Memory beyond FSDP's own: hooks mode holds this rank's per-sample gradients of the full parameters
until clipping ([B_rank, *p.shape] per parameter; use ghost mode for large models) and, in both
modes, one full-size float32 clipped-sum buffer per parameter while a logical batch is summed.

Plain gradients: in ghost mode the layers' parameters do not require grad during their forward,
so autograd computes no plain gradient and FSDP reduces nothing; in hooks mode autograd computes
them and FSDP reduce-scatters them into `p.grad` as usual, which the DP step then overwrites (a
wasted reduction: ghost mode is the one to use at scale).

Every rank must run the same number of forward and backward passes per step (FSDP's gathers are
collectives): with two or more ranks, a rank whose shard is empty, or has fewer physical chunks,
runs padding passes (`dptrain.data.virtual.in_lockstep`). A model cannot always run a batch of
0 rows (Hugging Face's attention reshapes by the batch size), so `ShardedPerSampleModule`
runs an empty batch on a placeholder: one row of zeros in every batched input, its outputs cut
back to 0 rows. The backward of a loss of those 0 rows sends zeros through every layer, so FSDP
gathers and reduces exactly as on the other ranks (the same layers, the same parameters). The
placeholder is no example: `per_sample_batch_size` reports 0 while its rows are captured, so
the optimizer discards them unclipped (`DPOptimizer.clip_and_accumulate`'s empty case): nothing
enters the clipped sum or adaptive clipping's unclipped count, and the accounting (q, and the
public denominator q * N) never sees it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.batch import pass_batch_size
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.randomness import derive_seeds, make_generator


def is_fully_sharded(module: Any) -> bool:
    """Whether `module` (or a submodule) was sharded with `torch.distributed.fsdp.fully_shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def _units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units (modules `fully_shard` was applied to) of `model`, in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP's record of every sharded parameter of `model` (its `FSDPParam`s), each once."""
    params = []
    for unit in _units(model):
        group = unit._get_fsdp_state()._fsdp_param_group
        params += [] if group is None else list(group.fsdp_params)
    return params


class ShardMap:
    """Each parameter of a fully sharded model as its sharded and its gathered object.

    Built on every rank at once (a collective: each unit is gathered and released once, one unit
    at a time, so that FSDP creates the gathered parameter objects the hooks are put on).

    Raises ConfigError when a trainable parameter is not sharded by FSDP (fully_shard the root
    module too) or not sharded along dim 0 over a 1-D mesh (HSDP, a custom shard_placement_fn).
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.tensor import Shard

        for unit in _units(model):
            unit.unshard()
            unit.reshard()
        records = {id(fp.sharded_param): fp for fp in _fsdp_params(model)}
        self.entries: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        self._records: list[Any] = []
        meshes = set()
        for name, param in model.named_parameters():
            record = records.get(id(param))
            if record is None:
                if param.requires_grad:
                    raise ConfigError(
                        f"module: the trainable parameter '{name}' is not sharded by FSDP, so its "
                        "clipped sums could not be reduced across the ranks. Apply fully_shard to "
                        "the root module as well (after its blocks), so FSDP manages every "
                        "parameter.")
                continue
            if tuple(param.placements) != (Shard(0),) or param.device_mesh.ndim != 1:
                raise ConfigError(
                    f"module: the parameter '{name}' is sharded as {param.placements} over a "
                    f"{param.device_mesh.ndim}-D mesh; make_private supports fully_shard's default "
                    "layout only (Shard(0) over a 1-D mesh of all ranks): call fully_shard without "
                    "shard_placement_fn and with a 1-D mesh.")
            meshes.add(tuple(param.device_mesh.mesh.flatten().tolist()))
            self.entries.append((name, param, record._unsharded_param))
            self._records.append(record)
        if len(meshes) > 1:
            raise ConfigError(f"module: its FSDP units are sharded over different ranks {sorted(meshes)}; "
                              "shard every unit over the same 1-D mesh of all ranks "
                              "(fully_shard(..., mesh=mesh)).")
        mesh = self.entries[0][1].device_mesh if self.entries else None
        group = mesh.get_group() if mesh is not None else None
        if group is not None and dist.get_world_size(group) != dist.get_world_size(dist.group.WORLD):
            raise ConfigError("module: its FSDP mesh spans a subgroup of the ranks; make_private "
                              "shards over all ranks (the Poisson sampler spans the world group): "
                              "call fully_shard with the default mesh.")
        self._sharded = {id(u): s for _, s, u in self.entries}
        self._gathered = {id(s): u for _, s, u in self.entries}

    @contextlib.contextmanager
    def gathered_registered(self) -> Iterator[None]:
        """Register the gathered parameter objects on their modules (without gathering their data:
        between passes their storage is empty) while the block runs, the sharded ones again after.

        Ghost clipping's norm and clipped-sum rules run at clipping time and key their results by
        the layer's parameters (`layer.weight`): they then find the objects the hooks saw. A rule
        that would read the parameters' values (a layer re-run) fails on the empty storage
        instead of reading wrong values.
        """
        for record in self._records:
            record._setattr_on_modules(record._unsharded_param)
        try:
            yield
        finally:
            for record in self._records:
                record._setattr_on_modules(record.sharded_param)

    def gathered_named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, gathered parameter): the objects the layers use while they run."""
        return [(n, u) for n, _, u in self.entries]

    def sharded_named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, sharded parameter): the objects the optimizer holds."""
        return [(n, s) for n, s, _ in self.entries]

    def to_sharded(self, values: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """`values` keyed by gathered parameters, re-keyed by their sharded parameters."""
        return {self._sharded[id(p)]: v for p, v in values.items()}

    def to_gathered(self, values: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """`values` keyed by sharded parameters, re-keyed by their gathered parameters."""
        return {self._gathered[id(p)]: v for p, v in values.items()}


def _gathered_view(base: type) -> type:
    """`base` (GradSampleModule or GhostClippingModule) hooking a sharded model's gathered
    parameters: `model_parameters` returns them instead of the registered (sharded) ones."""

    class Gathered(base):  # type: ignore[misc, valid-type]
        # a layer's output can be its FSDP unit's output, whose pre-backward hook gathers the
        # unit's parameters: the hooks must see the gathered objects, so they run after it
        hooks_after_later_ones = True

        def __init__(self, model: nn.Module, shards: ShardMap, **kwargs: Any) -> None:
            object.__setattr__(self, "_shard_map", shards)  # read by __init__'s hooks
            super().__init__(model, **kwargs)

        def model_parameters(self) -> list[tuple[str, nn.Parameter]]:
            return self._shard_map.gathered_named()

    Gathered.__name__ = Gathered.__qualname__ = f"Sharded{base.__name__}"
    return Gathered


class ShardedPerSampleModule(nn.Module):
    """The per-sample gradient source of a fully sharded model, keyed by its SHARDED parameters.

    Wraps a GradSampleModule / GhostClippingModule whose hooks sit on the gathered parameters
    (`ShardMap`) and exposes the clipping interface (docs/architecture.md, contract 1) with the
    sharded parameters as keys, the ones the optimizer holds: `squared_norms()` gives {p: Tensor[B]}
    (exact per-example norms over the full parameter, B this rank's examples) and `weighted_sum`
    {p: Tensor[*p.shape]} FULL-size (the global shape; this rank's examples only), which the
    sharded DP optimizer reduce-scatters into its rows at the step.
    """

    def __init__(self, source: nn.Module, shards: ShardMap) -> None:
        super().__init__()
        self._source = source
        object.__setattr__(self, "_shard_map", shards)
        #: placeholder rows run since the per-sample state was last cleared (padding passes)
        self._placeholder_rows = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; on an empty batch a padding pass: the model runs one placeholder
        row (zeros) and the outputs are cut back to 0 rows (see the module docstring)."""
        source = self._source
        dim = 0 if source.batch_first else 1
        empty = pass_batch_size(source._module, args, kwargs, source.batch_first).size == 0
        if torch.is_grad_enabled():
            self._refuse_mixed_rows(empty)
        if not empty:
            return source(*args, **kwargs)
        args, kwargs = _rows_of_zeros((args, kwargs), dim)
        if torch.is_grad_enabled():
            self._placeholder_rows += 1
        return _cut_to_no_rows(source(*args, **kwargs), dim)

    def _refuse_mixed_rows(self, padding: bool) -> None:
        """PrivacyError when a pass would add its rows to per-sample state that holds the other
        kind (examples and placeholder rows): the placeholder could then not be told apart."""
        if (self._source.per_sample_batch_size() if padding else self._placeholder_rows) > 0:
            raise PrivacyError(
                "a forward pass of the sharded model started while the per-sample gradients of "
                f"{'a padding pass (an empty batch)' if not padding else 'real examples'} were "
                "still pending. A padding pass runs a placeholder row whose gradient is "
                "discarded, which needs it alone in the per-sample state: call optimizer.step() "
                "(or optimizer.zero_grad()) after the backward of every batch or physical chunk, "
                "as dptrain.BatchMemoryManager's loop does.")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__["_modules"].get("_source")
            if name == "_source" or source is None:
                raise
            return getattr(source, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The sharded model's state dict (same keys as the model; DTensor values)."""
        return self._source.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._source.load_state_dict(state_dict, strict=strict, assign=assign)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, sharded parameter) of the trainable parameters, in model order."""
        return [(n, p) for n, p in self._shard_map.sharded_named() if p.requires_grad]

    def per_sample_batch_size(self) -> int:
        """The examples captured: 0 after a padding pass, whose placeholder row is no example
        (the one place it is excluded: the optimizer then clears it without clipping it)."""
        return 0 if self._placeholder_rows else self._source.per_sample_batch_size()

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        shards = self._shard_map
        with shards.gathered_registered():
            return shards.to_sharded(self._source.squared_norms())

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        shards = self._shard_map
        with shards.gathered_registered():
            return shards.to_sharded(self._source.weighted_sum(shards.to_gathered(weights)))

    def clear_per_sample(self) -> None:
        self._source.clear_per_sample()
        self._placeholder_rows = 0

    def check_complete(self) -> None:
        self._source.check_complete()

    def refuse_uncaptured_gradients(self) -> None:
        self._source.refuse_uncaptured_gradients()

    def remove_hooks(self) -> None:
        self._source.remove_hooks()


def _rows_of_zeros(value: Any, dim: int) -> Any:
    """`value` (tensors in tuples, lists, dicts) with every tensor of size 0 at the batch
    dimension `dim` replaced by one row of zeros there (same dtype and device): a placeholder
    (token id 0, mask 0, feature 0); other leaves as they are."""
    if isinstance(value, Tensor):
        if value.dim() <= dim or value.shape[dim] != 0:
            return value
        shape = list(value.shape)
        shape[dim] = 1
        return torch.zeros(shape, dtype=value.dtype, device=value.device)
    return _map_containers(value, lambda item: _rows_of_zeros(item, dim))


def _cut_to_no_rows(value: Any, dim: int) -> Any:
    """The outputs of a placeholder row as outputs of an empty batch: every tensor with one row
    at `dim` cut to 0 rows there, a floating scalar (a loss the model computed) times 0. Both
    stay in the graph, so a loss of them backpropagates zeros through every layer."""
    if isinstance(value, Tensor):
        if value.dim() > dim and value.shape[dim] == 1:
            return value.narrow(dim, 0, 0)
        return value * 0.0 if value.dim() == 0 and value.is_floating_point() else value
    return _map_containers(value, lambda item: _cut_to_no_rows(item, dim))


def _map_containers(value: Any, fn: Any) -> Any:
    """`fn` applied to each item of a tuple (namedtuple), list or dict (a Hugging Face
    ModelOutput keeps its class), the container rebuilt; any other value as it is."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(fn(item) for item in value)
    if isinstance(value, dict):
        mapped = copy.copy(value)
        for key, item in value.items():
            mapped[key] = fn(item)
        return mapped
    return value


def sharded_source(model: nn.Module, grad_sample_mode: str, batch_first: bool,
                   loss_reduction: str) -> ShardedPerSampleModule:
    """The per-sample gradient source of a fully sharded `model` ("hooks" | "ghost")."""
    shards = ShardMap(model)
    base = GradSampleModule if grad_sample_mode == "hooks" else GhostClippingModule
    source = _gathered_view(base)(model, shards, batch_first=batch_first,
                                  loss_reduction=loss_reduction)
    return ShardedPerSampleModule(source, shards)


# ----------------------------------------------------------------------------- reduction and noise
def local_rows(param: Any) -> Tensor:
    """This rank's rows of the sharded parameter `param` (its local tensor, [rows, *p.shape[1:]])."""
    return param.to_local()


def as_sharded(param: Any, local: Tensor) -> Any:
    """`local` ([rows of this rank, *p.shape[1:]]) as a DTensor laid out like `param`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def reduce_scatter_rows(full: Tensor, param: Any) -> Tensor:
    """The sum over ranks of `full` (Tensor[*param.shape], each rank's own) restricted to this
    rank's rows of `param`: one reduce-scatter over the parameter's mesh (padded to W equal
    chunks along dim 0, as FSDP pads its shards). Returns Tensor[rows, *param.shape[1:]]."""
    group = param.device_mesh.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = param.shape[0]
    chunk = -(-rows // world)  # rank r's rows are [r * chunk, min((r + 1) * chunk, rows))
    flat = full.reshape(rows, -1)
    padded = flat.new_zeros((chunk * world, flat.shape[1]))
    padded[:rows] = flat
    out = flat.new_empty((chunk, flat.shape[1]))
    # reduce_scatter_single: torch >= 2.14's name (reduce_scatter_tensor warns there)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, padded, group=group)
    mine = max(0, min(rows - rank * chunk, chunk))
    return out[:mine].reshape(local_rows(param).shape)


class ShardNoise:
    """Each rank's noise stream for its own rows: independent across ranks.

    `next_generator(base)` returns this step's generator: from `base` (the optimizer's noise
    generator), a seed is drawn (all ranks of a seeded run draw the same one) and split into one
    child seed per rank (`derive_seeds`); rank r draws from child r. An unseeded run's `base` is
    seeded from OS entropy on each rank, so the children differ across ranks too. In secure mode
    there is no generator: each rank draws from the OS CSPRNG.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def next_generator(self, base: torch.Generator | None) -> torch.Generator | None:
        if base is None:
            return None
        seed = int(torch.randint(0, 2**62, (1,), generator=base, device=base.device).item())
        return make_generator(derive_seeds(seed, self.world_size)[self.rank], device=base.device)


# ----------------------------------------------------------------------------- sharding a model
def block_classes(model: nn.Module) -> list[str]:
    """The class names of the model's transformer blocks, the default FSDP units: Hugging Face's
    `_no_split_modules` (its blocks, e.g. GPT2Block, BertLayer) when the model declares them,
    else the class of every container (nn.Sequential, nn.ModuleList) of two or more children of
    one class that own parameters (dptrain's Transformer: its Blocks)."""
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            return sorted(set(declared))
    found = []
    for module in model.modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and any(True for _ in module[0].parameters()):
            found.append(type(module[0]).__name__)
    return sorted(set(found))


def bf16_policy() -> Any:
    """FSDP's mixed precision for `hardware.precision=bf16`: the gathered parameters and the
    layers' compute in bf16, gradient reductions in float32 (the sharded parameters, their noise
    and the optimizer stay float32; per-sample norms and clipped sums are float32 as for any
    16-bit parameter)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, units: list[str] | None = None, mp_policy: Any = None) -> nn.Module:
    """`fully_shard` every module whose class name is in `units` (default `block_classes`), then
    the root; returns the model (sharded in place). `mp_policy`: FSDP's MixedPrecisionPolicy.

    Raises ConfigError naming `hardware.fsdp_units` when a named class is not in the model.
    """
    from torch.distributed.fsdp import fully_shard

    names = list(units) if units else block_classes(model)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present] if units else []
    if missing:
        raise ConfigError(f"hardware.fsdp_units={list(units or [])}: no module of class {missing} "
                          f"in the model; name classes it has (its blocks: {block_classes(model)}), "
                          "or leave the list empty for one unit per transformer block.")
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for module in [m for m in model.modules() if type(m).__name__ in names and m is not model]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


# ----------------------------------------------------------------------------- whole states
def _whole() -> Any:
    """Whole tensors, gathered to rank 0's CPU one at a time (the other ranks get nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict with every parameter whole, as one process's `state_dict()` (same
    keys). For a fully sharded model this is a collective (torch.distributed.checkpoint's
    `get_model_state_dict`): rank 0 receives the gathered tensors on the CPU, one at a time
    (never the whole model on its device), the other ranks an empty dict."""
    if not is_fully_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_whole())


def load_model_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a whole state dict (`model_state_dict`'s, or one process's) into `model`; a fully
    sharded model keeps each rank's rows (every rank passes the whole dict; a collective)."""
    if not is_fully_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def _parameter_names(model: nn.Module, optimizer: Any) -> list[str]:
    """The model's name of each parameter of `optimizer`, in its state dict's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict with whole tensors: for a fully sharded model keyed by parameter
    NAME (torch.distributed.checkpoint's `get_optimizer_state_dict`, a collective: rank 0
    receives it, the others an empty dict), so that it loads at any number of ranks; else
    `optimizer.state_dict()` (keyed by index, as always). `optimizer`: the plain torch optimizer
    (DCP may step it once with zero gradients to create its state: never the DP optimizer)."""
    if not is_fully_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_whole())


def _holds_tensors(state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict keeps any per-parameter tensor (a momentum buffer, Adam's
    moments); plain SGD keeps none."""
    return any(isinstance(v, torch.Tensor) for per_param in state.get("state", {}).values()
               for v in per_param.values())


def load_optimizer_state_dict(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Load `state` (keyed by parameter name, `optimizer_state_dict`'s; or by index, a plain
    `optimizer.state_dict()`) into `optimizer` on any number of ranks."""
    names = _parameter_names(model, optimizer)
    groups = state.get("param_groups", [])
    by_index = any(isinstance(i, int) for g in groups for i in g["params"])
    if is_fully_sharded(model) and _holds_tensors(state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if by_index:
            state = {"state": {names[i]: v for i, v in state["state"].items()},
                     "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                      for g in groups]}
        set_optimizer_state_dict(model, optimizer, state,
                                 options=StateDictOptions(full_state_dict=True))
        return
    # Unsharded, or a stateless optimizer (plain SGD: only its groups' settings, which torch's
    # sharded loader refuses for want of a tensor to place): the optimizer's own loader.
    if not by_index:
        index = {n: i for i, n in enumerate(names)}
        state = {"state": {index[n]: v for n, v in state["state"].items()},
                 "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]}
    optimizer.load_state_dict(state)
