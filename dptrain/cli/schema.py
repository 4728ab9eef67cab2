"""Typed configs: the schema of every config group, as Hydra structured configs.

Each option file in `dptrain/conf/<group>/` names its schema first in its defaults list
(`- /schema_<group>_<kind>`); the schemas are stored in Hydra's ConfigStore by `register()`, which
importing `dptrain.conf` runs. Hydra then refuses a value of the wrong type while composing
(`dataset.synthetic=maybe`, `train.epochs=ten`), and `dptrain.cli.main` reports it in one
paragraph naming the key, the value and what the key accepts (`accepts`).

A schema has exactly the keys of its option file, so the composed config (and the config hash
the ledger and resume rely on) is the one the yaml files alone would give. Values are checked
after composition by the layer that owns the rule: the `train` fields by `dptrain.train.settings.TrainSettings`, the
privacy fields by `dptrain.cli.privacy_config`, the hardware fields here (`check_hardware`) and in
`dptrain.distributed.launch`, dataset
and model options by the dataset loaders and model constructors. The yaml files stay the
user-facing defaults; the dataclasses below only give types (their defaults are never used),
except the privacy parts' (PLAN_PARTS, the budgets): an older flat privacy key replaces a nested
key left at that default (dptrain.cli.privacy_config), and a test holds them equal to the yaml.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from dptrain.checks import (
    NON_NEGATIVE_INT,
    NON_NEGATIVE_NUMBER,
    check_fields,
    field_rules,
    one_of,
    setting,
)
from dptrain.models.hf_config import DTYPES, QUANTIZE, TASKS
from dptrain.train.settings import TrainConfig

PRECISIONS = ("fp32", "bf16")


# ----------------------------------------------------------------------------- dataset
@dataclass
class DatasetConfig:
    """dataset/digits, mnist, cifar10 (checked by dptrain.data.datasets.load_dataset)."""

    name: str = MISSING
    root: Optional[str] = None
    download: bool = False
    synthetic: bool = False
    max_samples: Optional[int] = None
    validation_size: Any = 0            # a count (int) or a fraction (float)


@dataclass
class TextDatasetConfig(DatasetConfig):
    """dataset/imdb: a vocabulary size and a review length (tokens)."""

    vocab_size: int = 10000
    max_len: int = 256
    vocabulary: str = "hashing"         # hashing | train_counts (checked by the IMDb loader)


@dataclass
class PretrainedTextDatasetConfig(DatasetConfig):
    """dataset/glue_sst2, e2e_nlg: tokenised with a pretrained model's tokenizer (checked by
    dptrain.data.datasets.text)."""

    tokenizer: Optional[str] = None     # a folder or hub id (model.name_or_path by default)
    pad_token: Optional[str] = None     # model.pad_token by default
    max_len: int = 128


@dataclass
class TextFilesDatasetConfig(PretrainedTextDatasetConfig):
    """dataset/text: local CSV, JSON or Parquet files."""

    train_file: Optional[str] = None
    test_file: Optional[str] = None
    text_column: str = "text"
    label_column: Optional[str] = "label"   # null: a text-only (causal LM) dataset
    prompt_column: Optional[str] = None
    num_labels: int = 2
    user_column: Optional[str] = None   # privacy.unit=user: the column naming each row's user


# ----------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """A model option: `_target_` (a class or factory) and the keyword arguments it takes."""

    _target_: str = MISSING


@dataclass
class NamedModelConfig(ModelConfig):
    """A model of dptrain.models.get_model (checked by its constructor)."""

    name: str = MISSING
    num_classes: int = MISSING


@dataclass
class ResNetConfig(NamedModelConfig):
    in_channels: int = 3


@dataclass
class MLPConfig(NamedModelConfig):
    in_features: int = MISSING
    hidden_sizes: List[int] = dataclasses.field(default_factory=list)


@dataclass
class EmbeddingModelConfig(NamedModelConfig):
    vocab_size: int = MISSING
    embed_dim: int = MISSING


@dataclass
class LSTMModelConfig(EmbeddingModelConfig):
    hidden_size: int = MISSING


@dataclass
class TransformerConfig(NamedModelConfig):
    head: str = "classification"
    vocab_size: int = MISSING
    seq_len: int = MISSING
    n_layer: int = MISSING
    n_embd: int = MISSING
    n_head: int = MISSING


@dataclass
class HFModelConfig(ModelConfig):
    """model/hf: a pretrained Hugging Face model (checked by dptrain.models.hf.build_hf_model)."""

    name_or_path: str = MISSING
    task: str = setting(TASKS[0], one_of(*TASKS))
    num_labels: Optional[int] = None        # null: the dataset's number of classes
    dtype: str = setting(DTYPES[0], one_of(*DTYPES))
    freeze: List[str] = dataclasses.field(default_factory=list)
    # null or a mapping of LoraConfig's fields, checked by LoraConfig when the model is built
    # (typed as LoraConfig, OmegaConf cannot merge a mapping into the null node)
    lora: Any = None
    pad_token: Optional[str] = None
    download: bool = False
    freeze_embeddings: bool = False
    zero_init_head: bool = False
    # auto | model | mean | cls | max | mean_sqrt_len (dptrain.models.hf.pooling_of)
    pooling: str = "auto"
    # null | int8 | nf4: the frozen base stored in 8 or 4 bits (QLoRA; needs model.lora)
    quantize: Optional[str] = setting(None, one_of(*QUANTIZE).or_none())


# ----------------------------------------------------------------------------- optimizer
@dataclass
class OptimizerConfig:
    """What every optimizer option shares: its class, a learning rate, weight decay, and the
    rate of a pretrained model's new head (null: `lr`; `dptrain.models.hf.parameter_groups`)."""

    _target_: str = MISSING
    lr: float = setting(MISSING, NON_NEGATIVE_NUMBER)
    weight_decay: float = setting(0.0, NON_NEGATIVE_NUMBER)
    head_lr: Optional[float] = setting(None, NON_NEGATIVE_NUMBER.or_none())


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = setting(0.0, NON_NEGATIVE_NUMBER)


@dataclass
class AdamConfig(OptimizerConfig):
    betas: List[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])


def check_optimizer(optimizer: Any) -> None:
    """ConfigError naming the first `optimizer.*` value its rule refuses (lr, weight_decay,
    momentum: rules of every torch.optim optimizer that takes them)."""
    check_fields(optimizer, SGDConfig, "optimizer")


# ----------------------------------------------------------------------------- privacy
@dataclass
class PrivacyConfig:
    """privacy/none; the base of the private options."""

    name: str = MISSING


# The parts of the plan a private option configures, each a mapping of its kind and parameters
# (`privacy.noise: {kind: banded, bands: 4}`). Typed Any, not as dataclasses: a part may also be
# given as one word, its kind (`privacy.noise=banded`, the older flat form), which
# dptrain.cli.privacy_config reads and checks like every value of the group.
PLAN_PARTS: dict[str, dict[str, Any]] = {
    "sampling": {"kind": None, "groups": None},          # kind null: the noise picks
    "noise": {"kind": "independent", "bands": None, "buffers": None},
    "unit": {"kind": "example", "max_examples_per_user": None},
}


def _part(name: str) -> Any:
    return dataclasses.field(default_factory=lambda: dict(PLAN_PARTS[name]))


@dataclass
class BudgetConfig:
    """privacy.budget: a given noise multiplier (`sigma`; a `target_epsilon` is then a cap) or a
    target epsilon to calibrate sigma to, and the delta epsilon is stated at (null: 1/(10 N))."""

    sigma: Optional[float] = None
    target_epsilon: Optional[float] = None
    delta: Optional[float] = None


@dataclass
class SigmaBudgetConfig(BudgetConfig):
    sigma: Optional[float] = 1.0


@dataclass
class EpsilonBudgetConfig(BudgetConfig):
    target_epsilon: Optional[float] = 3.0


@dataclass
class DPSGDConfig(PrivacyConfig):
    """What privacy/epsilon and privacy/sigma share (checked by dptrain.cli.privacy_config): the
    plan's parts, nested (budget, sampling, noise, unit), the clipping and the accountant; then
    the older flat names of nested keys, ??? unless given (aliases, read into the parts)."""

    budget: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)
    sampling: Any = _part("sampling")   # {kind: poisson | shuffle | cyclic_poisson | balls_in_bins, groups}
    noise: Any = _part("noise")         # {kind: independent | banded | blt, bands, buffers}
    unit: Any = _part("unit")           # {kind: example | user, max_examples_per_user}
    max_grad_norm: Any = 1.0            # C, or a list of per-layer bounds (clipping=per_layer)
    clipping: str = "flat"
    accountant: str = "prv"
    grad_sample_mode: str = "hooks"
    secure_mode: bool = False
    reproducible_mechanism: bool = False
    # the older flat names (dptrain.train.ledger.hashing.FLAT_PRIVACY_KEYS); ??? (MISSING): not
    # given, so that a flat name set to null (privacy.target_epsilon=null) still says null
    target_delta: Optional[float] = MISSING
    sampling_groups: Optional[int] = MISSING
    poisson_sampling: Optional[bool] = MISSING   # false: sampling.kind=shuffle
    max_examples_per_user: Optional[int] = MISSING
    noise_bands: Optional[int] = MISSING
    noise_buffers: Optional[int] = MISSING


@dataclass
class EpsilonPrivacyConfig(DPSGDConfig):
    budget: BudgetConfig = dataclasses.field(default_factory=EpsilonBudgetConfig)
    target_epsilon: Optional[float] = MISSING


@dataclass
class SigmaPrivacyConfig(DPSGDConfig):
    budget: BudgetConfig = dataclasses.field(default_factory=SigmaBudgetConfig)
    noise_multiplier: Optional[float] = MISSING


# ----------------------------------------------------------------------------- noise schedule
@dataclass
class NoiseScheduleConfig:
    kind: str = MISSING


@dataclass
class ExponentialScheduleConfig(NoiseScheduleConfig):
    gamma: float = MISSING


@dataclass
class StepScheduleConfig(ExponentialScheduleConfig):
    step_size: int = MISSING


# ----------------------------------------------------------------------------- lr schedule
@dataclass
class LRScheduleConfig:
    """lr_schedule/constant (checked by dptrain.train.lr_schedule.LRSchedule)."""

    kind: str = MISSING


@dataclass
class WarmupLRScheduleConfig(LRScheduleConfig):
    """lr_schedule/linear, cosine: a warm-up, then a decay to 0."""

    warmup_steps: Optional[int] = None
    warmup_fraction: Optional[float] = None


# ----------------------------------------------------------------------------- audit
@dataclass
class AuditConfig:
    """audit/one_run (checked by dptrain.cli.audit.audit_settings)."""

    name: str = MISSING
    kind: str = "white_box"
    canaries: int = 1000
    confidence: float = 0.95
    score: str = "all_iterates"
    guesses: List[float] = dataclasses.field(default_factory=list)
    guess_sides: List[str] = dataclasses.field(default_factory=list)
    seed: int = 0
    norm_multiplier: float = 10.0


# ----------------------------------------------------------------------------- hardware
@dataclass
class HardwareConfig:
    """hardware/auto, cpu, cuda."""

    device: str = "auto"                # checked by dptrain.cli.build.build_device
    precision: str = setting("fp32", one_of(*PRECISIONS))
    num_workers: int = setting(0, NON_NEGATIVE_INT)


@dataclass
class DDPHardwareConfig(HardwareConfig):
    """hardware/ddp (its process settings are checked by dptrain.distributed.launch)."""

    distributed: bool = True
    nproc_per_node: int = 2
    nodes: int = 1
    backend: str = "auto"
    timeout_s: float = 300.0


@dataclass
class FSDPHardwareConfig(DDPHardwareConfig):
    """hardware/fsdp: DDP's process settings, the model sharded with fully_shard."""

    sharded: bool = True
    fsdp_units: List[str] = dataclasses.field(default_factory=list)  # class names; [] = blocks


def check_hardware(hardware: dict[str, Any]) -> None:
    """ConfigError naming the first `hardware.*` value its rule refuses."""
    check_fields(hardware, HardwareConfig, "hardware")


# ----------------------------------------------------------------------------- registration
# ConfigStore name -> (group the schema is for, schema). Option files name them in `defaults`.
SCHEMAS: dict[str, tuple[str, type]] = {
    "schema_train": ("train", TrainConfig),
    "schema_dataset": ("dataset", DatasetConfig),
    "schema_dataset_text": ("dataset", TextDatasetConfig),
    "schema_dataset_pretrained_text": ("dataset", PretrainedTextDatasetConfig),
    "schema_dataset_text_files": ("dataset", TextFilesDatasetConfig),
    "schema_model": ("model", ModelConfig),
    "schema_model_named": ("model", NamedModelConfig),
    "schema_model_resnet": ("model", ResNetConfig),
    "schema_model_mlp": ("model", MLPConfig),
    "schema_model_embedding": ("model", EmbeddingModelConfig),
    "schema_model_lstm": ("model", LSTMModelConfig),
    "schema_model_transformer": ("model", TransformerConfig),
    "schema_model_hf": ("model", HFModelConfig),
    "schema_optimizer_sgd": ("optimizer", SGDConfig),
    "schema_optimizer_adam": ("optimizer", AdamConfig),
    "schema_privacy_none": ("privacy", PrivacyConfig),
    "schema_privacy_epsilon": ("privacy", EpsilonPrivacyConfig),
    "schema_privacy_sigma": ("privacy", SigmaPrivacyConfig),
    "schema_noise_schedule": ("noise_schedule", NoiseScheduleConfig),
    "schema_noise_schedule_exponential": ("noise_schedule", ExponentialScheduleConfig),
    "schema_noise_schedule_step": ("noise_schedule", StepScheduleConfig),
    "schema_lr_schedule": ("lr_schedule", LRScheduleConfig),
    "schema_lr_schedule_warmup": ("lr_schedule", WarmupLRScheduleConfig),
    "schema_audit": ("audit", AuditConfig),
    "schema_hardware": ("hardware", HardwareConfig),
    "schema_hardware_ddp": ("hardware", DDPHardwareConfig),
    "schema_hardware_fsdp": ("hardware", FSDPHardwareConfig),
}


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent: a second store replaces the first)."""
    store = ConfigStore.instance()
    for name, (_, schema) in SCHEMAS.items():
        store.store(name=name, node=schema)


# ----------------------------------------------------------------------------- what a key accepts
def _describe(annotation: Any) -> str:
    """Words for a field type: int -> "an integer", Optional[float] -> "a number, or null"."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_describe(inner[0])}, or null"
    if typing.get_origin(annotation) in (list, List):
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s" if args else "a list"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        annotation, "a value")


def _accepted_by(schema: type, name: str) -> str | None:
    """What field `name` (dotted: a field of a typed sub-config) of `schema` accepts."""
    head, _, rest = name.partition(".")
    hints = typing.get_type_hints(schema)
    if rest:
        inner = hints.get(head)
        return _accepted_by(inner, rest) if dataclasses.is_dataclass(inner) else None
    rule = field_rules(schema).get(name)
    if rule is not None:
        return rule.accepts
    if name in hints and hints[name] is not Any:
        return _describe(hints[name])
    return None


def accepts(key: str) -> str | None:
    """What the config key `group.name` (`privacy.budget.sigma`: a nested one) accepts (its
    rule, else its type), from the schemas; None for a key no schema declares."""
    group, _, name = key.partition(".")
    for schema_group, schema in SCHEMAS.values():
        if schema_group == group and (found := _accepted_by(schema, name)) is not None:
            return found
    return None
