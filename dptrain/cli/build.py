"""Config -> objects: turn the composed Hydra config into a `TrainingJob` and `TrainSettings`.

Everything a user can get wrong is checked here, before any training step, and reported as a
`dptrain.errors` exception naming the config key and the fix. Order: settings, seeds, device,
dataset, model (built, validated for DP-SGD, dry-run on two examples), optimizer, loaders, then
`PrivacyEngine.make_private` (sigma given) or `make_private_with_epsilon` (sigma calibrated).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from torch import nn
from torch.utils.data import DataLoader, default_collate

import dptrain.cli.resolvers  # noqa: F401  (the configs' ${dptrain.*:...} resolvers)
from dptrain.cli.download import in_turns
from dptrain.cli.privacy_config import (  # noqa: F401  (privacy_mode: part of this module's API)
    PrivacyGroup,
    canonical_section,
    privacy_mode,
    reject_unknown_keys,
    without_unset_aliases,
)
from dptrain.accounting.calibration import steps_for
from dptrain.accounting.history import history_to_json
from dptrain.batches import call_model, inputs_and_targets
from dptrain.checks import default_delta
from dptrain.cli.schema import check_hardware, check_optimizer
from dptrain.data.datasets import DatasetSplits, load_dataset
from dptrain.data.datasets.selection import new_split_key
from dptrain.data.datasets.text import TOKENIZER_KEY
from dptrain.distributed.launch import join_run, wrap_model
from dptrain.distributed.runtime import broadcast_object
from dptrain.errors import (
    ConfigError,
    DPTrainError,
    PrivacyError,
    UnreachableEpsilonError,
    UnsupportedModuleError,
)
from dptrain.formatting import format_epsilon
from dptrain.models.hf import check_task, loss_for_task, parameter_groups
from dptrain.data.sampling import default_sample_rate
from dptrain.data.user_sampling import user_sample_rate
from dptrain.privacy.engine import PrivacyEngine
from dptrain.privacy.plan import PerformanceSettings, PrivacyPlan, calibrated, planned_history
from dptrain.train.checkpoint import resolve_resume, saved_split_key
from dptrain.train.job import PrivacySettings, TrainingJob, check_model_selection
from dptrain.train.loggers import make_loggers
from dptrain.randomness import seed_everything
from dptrain.train.settings import TrainConfig, TrainSettings, command_line_names, sized_for
from dptrain.validation import invalid_model_error

log = logging.getLogger(__name__)

# Every key the `train` section may hold: the fields of TrainConfig.
TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
EVAL_BATCH_SIZE = 1024
FOLLOWED_KEY = "model.name_or_path"  # what a text dataset's tokenizer follows by default


# ----------------------------------------------------------------------------- config helpers
def resolve_config(cfg: DictConfig, nested_privacy: bool = True) -> dict[str, Any]:
    """The config as plain Python values, every interpolation resolved (for the ledger's hash),
    the privacy group in its nested form (`nested_privacy=False`: as composed, its older flat
    names still there; dptrain.cli.privacy_config).

    Raises ConfigError naming the key of a missing mandatory value (`???`) or a bad interpolation.
    """
    resolved = _resolved(without_unset_aliases(cfg))
    if nested_privacy and isinstance(resolved.get("privacy"), dict):
        resolved["privacy"] = canonical_section(resolved["privacy"])
    return resolved


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """OmegaConf's plain values of `cfg`; ConfigError naming a missing value or a bad
    interpolation."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as error:
        key = error.full_key or "?"
        raise ConfigError(
            f"config key {key} has no value (it is ??? in its config file): set it on "
            f"the command line, e.g. {key}=VALUE."
        ) from error
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"config key {error.full_key or '?'} cannot be resolved: "
            f"{error.msg}. Fix the value or the ${{...}} interpolation it uses."
        ) from error


def _require(section: dict[str, Any], group: str, key: str) -> Any:
    """`section[key]`, or a ConfigError naming `group.key`."""
    if key not in section:
        raise ConfigError(
            f"config key {group}.{key} is missing: add {group}.{key}=VALUE "
            f"(or +{group}.{key}=VALUE when the {group} config has no such key)."
        )
    return section[key]


# ----------------------------------------------------------------------------- train settings
def build_settings(train: dict[str, Any], run_dir: Path,
                   lr_schedule: dict[str, Any] | None = None) -> TrainSettings:
    """TrainSettings from the `train` group and the `lr_schedule` group, with every value
    checked (by TrainSettings and LRSchedule, their refusals naming the config keys)."""
    reject_unknown_keys(train, "train", TRAIN_KEYS)
    for key in ("epochs", "batch_size"):
        _require(train, "train", key)
    with command_line_names():
        return TrainSettings(run_dir=run_dir, lr_schedule=lr_schedule, **train)


def size_train(train: dict[str, Any], num_units: int, units: str) -> None:
    """Fill a null `train.batch_size` or `train.epochs` in place with the sizing rule for
    `num_units` privacy units (`units`: "training examples", or "users" at user level, where a
    batch counts users; dptrain.train.settings.sized_for; model=hf leaves both null), and say so
    in the run's log. The filled values are what the ledger records."""
    missing = [key for key in ("batch_size", "epochs") if key in train and train[key] is None]
    if not missing:
        return
    chosen = dict(zip(("batch_size", "epochs"), sized_for(num_units)))
    for key in missing:
        train[key] = chosen[key]
    log.info("train.%s null: %s for N = %d %s (the sizing rule of "
             "docs/transformers.md; set the key to choose it).", " and train.".join(missing),
             ", ".join(f"{key} = {train[key]}" for key in missing), num_units, units)


# ----------------------------------------------------------------------------- hardware
def build_device(hardware: dict[str, Any]) -> torch.device:
    """`hardware.device`: auto (CUDA if available) | cpu | cuda | cuda:N."""
    name = str(hardware.get("device", "auto"))
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(
            f"hardware.device={name!r} is not a device: use auto, cpu, cuda or cuda:N."
        ) from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"hardware.device={name} but no CUDA GPU is visible: use hardware=cpu "
            f"(or hardware=auto) on this machine."
        )
    return device


def build_precision(hardware: dict[str, Any]) -> str:
    """`hardware.precision`: fp32 | bf16 (autocast); the hardware values checked."""
    check_hardware(hardware)
    return str(hardware.get("precision", "fp32"))


# ----------------------------------------------------------------------------- dataset, model
def build_dataset(dataset: dict[str, Any], seed: int,
                  tokenizer_named_by: str = TOKENIZER_KEY,
                  split_key: bytes | None = None) -> DatasetSplits:
    """The train/test (and validation) splits named by `dataset.name` with the group's options.

    With `dataset.download=true` under hardware=ddp the ranks take turns (rank 0 first), so that
    no two ranks download into the same `dataset.root` at once (dptrain.cli.download).
    `tokenizer_named_by` is the key the user set the tokenizer with (`tokenizer_key`): an error
    about the tokenizer names it instead of dataset.tokenizer. `split_key` chooses the rows of
    `dataset.max_samples` and `dataset.validation_size` (`split_key_for`; None: a fresh one).
    """
    options = dict(dataset)
    name = _require(options, "dataset", "name")
    options.pop("name")
    if options.get("root") is None:
        options.pop("root", None)
    if "split_key" in options:
        raise ConfigError(
            "dataset.split_key is not a config key: the key that chooses the rows of "
            "dataset.validation_size and dataset.max_samples is secret (the ledger publishes "
            "the config). dptrain draws it from OS entropy and a resume reads it from the "
            "checkpoint; remove dataset.split_key.")
    try:
        if options.get("download"):
            return in_turns(lambda: load_dataset(name, seed=seed, split_key=split_key,
                                                 **options))
        return load_dataset(name, seed=seed, split_key=split_key, **options)
    except ConfigError as error:
        if tokenizer_named_by == TOKENIZER_KEY or TOKENIZER_KEY not in str(error):
            raise
        raise ConfigError(str(error).replace(TOKENIZER_KEY, tokenizer_named_by)) from error


def split_key_for(resume: str | None, run_dir: Path) -> bytes:
    """The secret split key of a run (dptrain.data.datasets.selection): the one saved in the
    checkpoint `train.resume` names (`auto`: the run folder's newest), so that a resumed run
    trains on the rows it trained on; else (a new run, or a checkpoint without one) a fresh key
    from OS entropy. Rank 0's on every rank of a hardware=ddp run."""
    saved = saved_split_key(resolve_resume(resume, run_dir))
    return broadcast_object(saved if saved is not None else new_split_key())


def tokenizer_key(cfg: DictConfig) -> str:
    """The key that set a text dataset's tokenizer: `model.name_or_path` when dataset.tokenizer
    still follows it (the text datasets' default, `${oc.select:model.name_or_path,null}`), else
    dataset.tokenizer."""
    dataset = cfg.get("dataset")
    raw = OmegaConf.to_container(dataset, resolve=False).get("tokenizer") if isinstance(
        dataset, DictConfig) else None
    follows = isinstance(raw, str) and "${" in raw and FOLLOWED_KEY in raw
    return FOLLOWED_KEY if follows else TOKENIZER_KEY


def warn_private_preprocessing(splits: DatasetSplits) -> None:
    """A logged warning for each preprocessing step that read the private training examples,
    each sentence saying what epsilon covers of it (the ledger's `dataset.private_preprocessing`
    records them too)."""
    for step in splits.private_preprocessing:
        log.warning("Preprocessing read the private training data: %s.", step.rstrip("."))


def _unwrap_instantiation(error: InstantiationException, group: str, target: str) -> DPTrainError:
    """A DPTrainError raised inside the constructor, or a ConfigError naming `group._target_`."""
    cause = error.__cause__
    while cause is not None and not isinstance(cause, DPTrainError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, DPTrainError):
        return cause
    return ConfigError(
        f"{group} could not be built from {group}._target_={target}: {error}. Check "
        f"{group}._target_ (an importable class or function) and its keyword arguments."
    )


def build_model(model_cfg: DictConfig, splits: DatasetSplits | None = None,
                device: torch.device | None = None) -> nn.Module:
    """The model built by Hydra's `instantiate` from the `model` group (`_target_` + kwargs).

    A `num_labels: null` (model=hf) takes the dataset's number of classes from `splits`; a
    quantized base (model=hf model.quantize) is loaded straight onto `device` (transformers'
    device_map): bitsandbytes keeps its scales in attributes of the weights, which
    `nn.Module.to` does not move.
    """
    target = str(model_cfg.get("_target_", "?"))
    extra: dict[str, Any] = {}
    if splits is not None and "num_labels" in model_cfg and model_cfg.num_labels is None:
        extra["num_labels"] = splits.num_classes
    if device is not None and model_cfg.get("quantize") is not None:
        extra["device"] = str(device)
    try:
        model = instantiate(model_cfg, **extra)
    except InstantiationException as error:
        raise _unwrap_instantiation(error, "model", target) from error
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={target} returned a {type(model).__name__}, not a "
            f"torch.nn.Module: point model._target_ at a model class or factory."
        )
    return model


def model_error_in_keys(error: UnsupportedModuleError, model_key: str) -> UnsupportedModuleError:
    """The model validation's refusal (raised once, where make_private wraps the model) said
    again for the command line: naming `model=KEY` and the command's choices; other refusals
    as they are."""
    if not error.problems:
        return error
    return invalid_model_error(
        error.problems, f"model={model_key}",
        "Choose a DP-compatible model (model=...), build yours with "
        "dptrain.ModuleValidator.fix(model) applied in its constructor, or train without privacy "
        "(privacy=none).")


def check_model_fits_data(model: nn.Module, splits: DatasetSplits, model_key: str) -> None:
    """Run the model on two training examples: inputs accepted and one logit per class (per
    token and vocabulary entry for a causal LM dataset); a pretrained model's task must be the
    dataset's."""
    task = splits.info.get("task")
    if task is not None and isinstance(getattr(model, "task", None), str):
        check_task(model.task, task, splits.name)
    batch = default_collate([splits.train[i] for i in range(min(2, len(splits.train)))])
    inputs, _ = inputs_and_targets(batch)   # (x, y), or a text dataset's {input_ids, ...}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = call_model(model, inputs)
    except (RuntimeError, ValueError, IndexError, TypeError) as error:
        shapes = ({k: list(v.shape[1:]) for k, v in inputs.items()} if isinstance(inputs, dict)
                  else list(inputs.shape[1:]))
        raise ConfigError(
            f"model={model_key} cannot take dataset={splits.name} inputs of shape "
            f"{shapes} ({type(error).__name__}: {str(error).splitlines()[0]}). "
            f"Pick a model made for this dataset (e.g. +recipe=... sets both) or adjust the model's "
            f"config keys."
        ) from error
    finally:
        model.train(was_training)
    if task == "causal_lm":
        if output.dim() != 3 or output.shape[-1] < splits.num_classes:
            raise ConfigError(
                f"model={model_key} outputs shape {list(output.shape[1:])} per example but "
                f"dataset={splits.name} holds token ids of a {splits.num_classes}-token vocabulary: "
                f"use a causal LM (model=hf model.task=causal_lm) with the dataset's tokenizer."
            )
        return
    if output.dim() != 2 or output.shape[-1] != splits.num_classes:
        raise ConfigError(
            f"model={model_key} outputs shape {list(output.shape[1:])} per example but "
            f"dataset={splits.name} has {splits.num_classes} classes: set model.num_classes="
            f"{splits.num_classes} (or the model's equivalent key)."
        )


def build_optimizer(optimizer_cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The `optimizer` group (`_target_: torch.optim.SGD`, lr, ...) over the trainable parameters;
    a pretrained model's new head at `optimizer.head_lr` when set (`parameter_groups`)."""
    target = str(optimizer_cfg.get("_target_", "?"))
    check_optimizer(optimizer_cfg)
    options = OmegaConf.to_container(optimizer_cfg, resolve=True)
    groups = parameter_groups(model, options.pop("head_lr", None))
    try:  # partial: Hydra would turn the groups (dicts of tensors) into configs
        optimizer = instantiate(options, _partial_=True)(groups)
    except InstantiationException as error:
        raise _unwrap_instantiation(error, "optimizer", target) from error
    except (TypeError, ValueError) as error:  # the constructor's refusal of a keyword or value
        raise ConfigError(
            f"optimizer could not be built from optimizer._target_={target}: "
            f"{type(error).__name__}: {error}. Check its keyword arguments (optimizer.*)."
        ) from error
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer._target_={target} is not a torch.optim.Optimizer.")
    return optimizer


# ----------------------------------------------------------------------------- loaders
def build_loaders(
    splits: DatasetSplits, settings: TrainSettings, num_workers: int, shuffle: bool
) -> tuple[DataLoader, DataLoader, DataLoader | None]:
    """Train loader (batch `train.batch_size`, seeded; replaced by Poisson sampling when private),
    test loader and validation loader (fixed order; None without a validation split)."""
    if settings.batch_size > len(splits.train):
        raise ConfigError(
            f"train.batch_size={settings.batch_size} is larger than the {len(splits.train)} training "
            f"examples of dataset={splits.name}: lower train.batch_size (the sample rate "
            f"batch_size / N must be at most 1)."
        )
    generator = torch.Generator().manual_seed(settings.seed)
    train = DataLoader(
        splits.train,
        batch_size=settings.batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        generator=generator,
    )
    eval_batch = min(EVAL_BATCH_SIZE, settings.max_physical_batch_size or EVAL_BATCH_SIZE)

    def in_order(dataset: torch.utils.data.Dataset) -> DataLoader:
        return DataLoader(dataset, batch_size=eval_batch, shuffle=False, num_workers=num_workers)

    validation = None if splits.validation is None else in_order(splits.validation)
    return train, in_order(smoke_test_split(splits, settings)), validation


def smoke_test_split(splits: DatasetSplits, settings: TrainSettings) -> torch.utils.data.Dataset:
    """The test split a run evaluates: all of it, except in a smoke test (synthetic data,
    `dataset.synthetic=true`, with `train.max_steps` set), which evaluates as many test
    examples as it trains on, max_steps x batch_size (its accuracy on random data means nothing,
    and the 25,000 synthetic IMDb test reviews would take minutes); said in a note."""
    test = splits.test
    if not splits.info.get("synthetic") or settings.max_steps is None:
        return test
    cap = settings.max_steps * settings.batch_size
    if cap >= len(test):
        return test
    from dptrain.train.display import note

    note(f"Smoke test (dataset.synthetic=true, train.max_steps={settings.max_steps}): evaluating "
         f"on the first {cap:,} of the {len(test):,} synthetic test examples "
         "(train.max_steps x train.batch_size).")
    return torch.utils.data.Subset(test, range(cap))


# ----------------------------------------------------------------------------- privacy
def _target_delta(configured: Any, num_examples: int, unit: str = "training examples",
                  key: str = "privacy.budget.delta") -> float:
    """`privacy.budget.delta` (`key`: as the user spelled it), or the 1/(10 N) rule when it is
    null (said in the run's log); N counts `unit` (examples, or users with privacy.unit=user)."""
    if configured is not None:
        delta = float(configured)
        if num_examples and delta >= 1.0 / num_examples:
            raise ConfigError(
                f"{key}={configured} is not below 1/N = {1.0 / num_examples:.3g} "
                f"(N = {num_examples} {unit}): a mechanism that publishes one random "
                f"training example (or user) satisfies that delta, so the epsilon reported would protect no "
                f"one. Set {key} well below 1/N, e.g. "
                f"{default_delta(num_examples):g}, or null for 1/(10 N) rounded down.")
        return delta
    delta = default_delta(num_examples)
    log.info(
        "%s is null: using delta = %g, 1/(10 N) rounded down to a power of "
        "ten for N = %d %s (set %s to choose it).",
        key,
        delta,
        num_examples,
        unit,
        key,
    )
    return delta


def _unreachable_in_keys(error: UnreachableEpsilonError, settings: TrainSettings,
                         num_examples: int, key: str = "privacy.budget.target_epsilon"
                         ) -> PrivacyError:
    """The calibration's refusal said again in the config keys that set its numbers (`key`: the
    target epsilon's, as the user spelled it)."""
    return PrivacyError(
        f"{key}={error.target_epsilon:g} cannot be reached: "
        f"train.epochs={settings.epochs} at train.batch_size={settings.batch_size} of "
        f"N = {num_examples} training examples is {error.steps} steps at sample rate "
        f"{error.sample_rate:.3g}, and even sigma = 10000 spends epsilon {format_epsilon(error.best)} at "
        f"delta {error.delta:g}. Raise {key} to at least {format_epsilon(error.best)}, or "
        f"lower train.epochs or train.batch_size.")


def user_level_arguments(request: PrivacyGroup, dataset: Any) -> dict[str, Any]:
    """make_private's arguments from the training set that its privacy unit needs: the user
    ids for privacy.unit=user (the training split's, from dataset.user_column); {} for
    example-level privacy. ConfigError when the dataset has no user ids (`Unit.data_arguments`)."""
    return request.unit.data_arguments(dataset)


def privacy_units(request: PrivacyGroup, dataset: Any) -> tuple[int, str]:
    """(N, what N counts): the privacy units of the training split, its users at user level
    (what a batch and the sample rate count there), else its examples (`Unit.count`)."""
    return request.unit.count(dataset)


def planned_steps(sample_rate: float, settings: TrainSettings) -> int:
    """The steps the run takes: train.epochs of ceil(1 / q) steps, at most train.max_steps."""
    steps = steps_for(sample_rate, None, settings.epochs)
    return steps if settings.max_steps is None else min(steps, settings.max_steps)


def sgd_momentum(optimizer: torch.optim.Optimizer) -> float:
    """The heavy-ball momentum of an SGD optimizer's first group (0 for other optimizers): the
    workload a correlated noise strategy is optimised for."""
    if not isinstance(optimizer, torch.optim.SGD) or not optimizer.param_groups:
        return 0.0
    return float(optimizer.param_groups[0].get("momentum", 0.0) or 0.0)


def job_plan(request: PrivacyGroup, loader: DataLoader, settings: TrainSettings,
             num_examples: int, momentum: float = 0.0) -> tuple[PrivacyPlan, dict[str, Any]]:
    """(plan, user-level arguments of make_private) of a private `request` for the training
    `loader` of `num_examples` examples: q = batch_size / N (N: examples, or users with
    privacy.unit=user), delta by the 1/(10 N) rule when null, sigma calibrated for
    `train.epochs` with privacy=epsilon; `momentum` is SGD's (correlated noise is optimised
    for it)."""
    unit = user_level_arguments(request, loader.dataset)
    num_units, units = privacy_units(request, loader.dataset)
    delta = _target_delta(request.target_delta, num_units, units, request.key("budget.delta"))
    rate = user_sample_rate(loader, num_units) if unit else default_sample_rate(loader, num_examples)
    plan = request.plan(rate, delta, steps=planned_steps(rate, settings), momentum=momentum)
    if plan.noise.multiplier is None:
        try:
            plan = calibrated(plan, settings.epochs)
        except UnreachableEpsilonError as error:
            raise _unreachable_in_keys(error, settings, num_units,
                                       request.key("budget.target_epsilon")) from error
    return plan, unit


def planned_cost(cfg: DictConfig) -> dict[str, Any]:
    """What a run of `cfg` will spend if it runs to its end, known before it reads a batch:
    {"history": its (sigma, q, steps) runs as JSON (dptrain.privacy.plan.planned_history over
    `planned_steps`), or None for privacy=none; "sampling": how the steps are charged (the
    selection: poisson, shuffle; qualified when the noise is correlated or the selection cyclic,
    as the sweep ledger names a job's)}.

    Loads the dataset (for N, and the users with privacy.unit=user) but builds no model: the
    plan and the settings are those `build_job` builds. A budget cap (privacy.target_epsilon with
    a given sigma) can only stop the run earlier, so the history bounds what it spends. SGD's
    momentum is taken as 0: it shapes only a correlated noise strategy, whose steps a sweep
    does not compose anyway."""
    resolved = resolve_config(cfg, nested_privacy=False)
    for group in ("dataset", "privacy", "train"):
        _require(resolved, "config", group)
    train = resolved["train"]
    request = PrivacyGroup.parse(resolved["privacy"], resolved.get("noise_schedule"))
    if not request.private:
        return {"history": None, "sampling": "none"}
    splits = build_dataset(resolved["dataset"], int(train.get("seed", 0)), tokenizer_key(cfg))
    size_train(train, *privacy_units(request, splits.train))  # as build_job sizes it
    settings = build_settings(train, Path("."), resolved.get("lr_schedule"))
    loader = DataLoader(splits.train, batch_size=settings.batch_size)
    plan, _ = job_plan(request, loader, settings, len(splits.train))
    kind = plan.selection.kind
    steps = planned_steps(plan.selection.sample_rate, settings)
    return {"history": history_to_json(planned_history(plan, steps)),
            "sampling": kind if plan.accounting.plain
            else f"{kind} with correlated noise or sampling groups"}


def make_private_job(
    request: PrivacyGroup,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    settings: TrainSettings,
    num_examples: int,
) -> tuple[Any, nn.Module, torch.optim.Optimizer, DataLoader, PrivacySettings]:
    """`request`'s plan applied through the engine: (engine, model, optimizer, loader, settings).

    The noise and Poisson sampling generators are seeded from OS entropy, or from `train.seed`
    with `privacy.reproducible_mechanism=true`; with privacy=epsilon sigma is calibrated for
    `train.epochs` first (`calibrated`).
    """
    if not request.private:
        return None, model, optimizer, loader, PrivacySettings(enabled=False)
    plan, unit = job_plan(request, loader, settings, num_examples, sgd_momentum(optimizer))
    engine = PrivacyEngine.for_plan(plan, seed=settings.seed)
    performance = PerformanceSettings(grad_sample_mode=request.grad_sample_mode)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
                                                   data_loader=loader, plan=plan,
                                                   performance=performance, **unit)
    return engine, model, optimizer, loader, PrivacySettings.of_engine(engine)


# ----------------------------------------------------------------------------- the whole job
def _model_key(cfg: DictConfig) -> str:
    """How the user named the model: the group option's `name` (a pretrained model's
    `name_or_path`), else its `_target_`."""
    model = cfg.model
    return str(model.get("name") or model.get("name_or_path") or model.get("_target_", "?"))


def build_job(cfg: DictConfig, run_dir: Path, prepare_splits: Callable[[DatasetSplits],
              DatasetSplits] | None = None) -> tuple[TrainingJob, TrainSettings]:
    """Everything `dptrain.train.train` needs, built from the composed config; all checks up front.

    `prepare_splits`, when given, changes the dataset splits before anything is built from them
    (an audit's black-box canaries: cli/audit.py).
    """
    resolved = resolve_config(cfg, nested_privacy=False)
    for group in ("model", "dataset", "privacy", "hardware", "optimizer", "train"):
        _require(resolved, "config", group)
    # checked, and recorded in its nested form whichever names the command used
    request = PrivacyGroup.parse(resolved["privacy"], resolved.get("noise_schedule"))
    resolved["privacy"] = dict(request.section)
    run_dir = join_run(resolved, run_dir)  # same config on every rank; rank 0's run folder
    train, lr_schedule = resolved["train"], resolved.get("lr_schedule")
    # every value checked before the data loads; the keys the data will size stand in as 1 (the
    # batch as the physical chunk's size, which may not exceed it)
    stand_in = {"epochs": 1, "batch_size": train.get("max_physical_batch_size") or 1}
    build_settings({**train, **{k: v for k, v in stand_in.items()
                                if k in train and train[k] is None}}, run_dir, lr_schedule)
    seed = int(train.get("seed", 0))
    check_model_selection(bool(train.get("keep_best")),
                          bool(resolved["dataset"].get("validation_size")))
    seed_everything(seed)  # before the model's initialisation (the loop seeds alike)
    hardware = resolved["hardware"]
    device, precision = build_device(hardware), build_precision(hardware)
    num_workers = int(hardware.get("num_workers", 0))
    splits = build_dataset(resolved["dataset"], seed, tokenizer_key(cfg),
                           split_key_for(train.get("resume"), run_dir))
    if prepare_splits is not None:
        splits = prepare_splits(splits)
    size_train(train, *privacy_units(request, splits.train))
    settings = build_settings(train, run_dir, lr_schedule)
    warn_private_preprocessing(splits)
    model_key = _model_key(cfg)
    if isinstance(resolved["model"].get("task"), str) and "task" in splits.info:
        check_task(resolved["model"]["task"], splits.info["task"], splits.name)  # before loading
    model = build_model(cfg.model, splits, device)
    check_model_fits_data(model, splits, model_key)
    model = wrap_model(model.to(device), resolved)  # DDP on hardware=ddp
    optimizer = build_optimizer(cfg.optimizer, model)
    train_loader, test_loader, validation_loader = build_loaders(
        splits, settings, num_workers, shuffle=not request.private
    )
    try:
        engine, model, optimizer, train_loader, privacy = make_private_job(
            request, model, optimizer, train_loader, settings, len(splits.train))
    except UnsupportedModuleError as error:
        raise model_error_in_keys(error, model_key) from None
    job = TrainingJob(
        model=model,
        optimizer=optimizer,
        train_loader=train_loader,
        test_loader=test_loader,
        loss_fn=loss_for_task(splits.info.get("task")),
        device=device,
        engine=engine,
        privacy=privacy,
        dataset_name=splits.name,
        dataset_size=len(splits.train),
        config=resolved,
        precision=precision,
        validation_loader=validation_loader,
        private_preprocessing=list(splits.private_preprocessing),
        synthetic=bool(splits.info.get("synthetic", False)),
        split_key=splits.split_key,
    )
    return job, settings


# ----------------------------------------------------------------------------- metric loggers
def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Any]:
    """The loggers the `logger` group selects ({name: options}; none after `logger=[]`, and
    the run still writes its metrics.jsonl: dptrain.train.loggers.with_run_record).

    Built before anything else, so an unknown option or a missing package (logger=wandb without
    wandb) stops the run before the data is loaded; they open their files on first use.
    """
    specs = resolve_config(cfg).get("logger") or {}
    return make_loggers(specs, run_dir)
