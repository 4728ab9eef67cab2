"""Pretrained Hugging Face models for private fine-tuning: full, partly frozen, or with LoRA.

`build_hf_model(name_or_path, task=..., ...)` loads a `transformers` model from a local folder
(written by `save_pretrained`) or, only when `download=True`, from the Hugging Face hub (a hub id
already in the local cache loads without a download), optionally freezes parameters by name
pattern and adds LoRA adapters with `peft`, and returns an :class:`HFModel`: token ids and
attention mask in, logits out.
A sentence-transformers checkpoint is classified from the pooling it declares
(`dptrain.models.hf_pooling.PooledClassifier`; `pooling_of` says when).

Inputs are `input_ids` and `attention_mask`, `[B, T]` int64 each, right padded: the batches of
`dptrain.data.datasets.text` (`{input_ids, attention_mask, labels}`), which the training loop's
loss step (`dptrain.losses.ModelLoss`) passes as `model(input_ids=..., attention_mask=...)` and
scores against `labels`. One packed `[B, 2T]` tensor (ids then mask, `pack_inputs`: the input of
earlier versions) is still accepted. Each batch is cut to its longest sequence before the
forward pass (padding changes nothing but the cost). Outputs: `[B, num_labels]`
(`task="sequence_classification"`) or `[B, T', V]` (`task="causal_lm"`, `T'` the batch's longest
sequence); `loss_for_task(task)` is the matching per-sample loss (cross-entropy, or the mean
cross-entropy over a sample's own tokens with padding and prompt tokens masked out).

With `quantize="int8"` or `"nf4"` (QLoRA) the frozen base's Linear layers are stored in 8 or 4
bits by `bitsandbytes` (the `[quantize]` extra) and only the LoRA adapters train: they are plain
`nn.Linear` pieces fed by the quantized layers' activations, so their per-sample gradients are
exact as over any frozen base (docs/transformers.md, "QLoRA").

`transformers` and `peft` (the `[hf]` extra) are imported when a model is built, never at import.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

# the packed input [B, 2T] of earlier versions is the text datasets' stored layout
from dptrain.data.datasets.text import pack_rows as pack_inputs  # noqa: F401
from dptrain.data.datasets.text import unpack_rows
from dptrain.errors import ConfigError
from dptrain.losses import IGNORE_INDEX, TokenLoss
from dptrain.models.hf_config import (DTYPES, PEFT_TASK_TYPES, TASKS, LoraConfig,
                                      check_quantize)
from dptrain.models.hf_pooling import (POOLING_MODES, PooledClassifier, local_reader,
                                       sentence_pooling)
# where pretrained files come from and the tokenizer (moved to dptrain.pretrained, which the
# text datasets read too; these names stay importable from here)
from dptrain.pretrained import (TOKENIZER_FILES, from_pretrained,  # noqa: F401
                                import_transformers, is_local, load_tokenizer)

MAX_LISTED = 6           # module / column names quoted in an error
# Layers a quantized base keeps in model.dtype: a causal LM's output layer (transformers' own
# default, which an explicit list replaces) and the classifier heads PEFT trains whole for
# sequence classification (its `classifier_module_names`); model.lora.modules_to_save joins them.
UNQUANTIZED_MODULES = ("lm_head", "classifier", "score")


# ----------------------------------------------------------------------------- progress bars
@contextlib.contextmanager
def _no_progress_bars(quiet: bool, transformers: Any) -> Iterator[None]:
    """transformers' progress bars off while loading files already here (`quiet`); a download
    keeps them. Restored afterwards."""
    logging = transformers.utils.logging
    was_on = logging.is_progress_bar_enabled()
    if quiet and was_on:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_on:
            logging.enable_progress_bar()


# ----------------------------------------------------------------------------- the wrapper
def unpack_inputs(x: Tensor) -> tuple[Tensor, Tensor]:
    """The packed model input `[B, 2T]` (ids then mask, `pack_inputs`) -> (ids, mask), `[B, T]`
    each. ConfigError when `x` cannot be one: an odd width, or a second half that is no mask of
    right-padded examples (`_is_right_padded_mask`; token ids passed alone: give
    `attention_mask=` too)."""
    width = x.shape[1] if x.dim() == 2 else None
    ids, mask = unpack_rows(x) if width is not None and width % 2 == 0 else (x, None)
    if mask is None or not _is_right_padded_mask(x, mask):
        raise ConfigError(
            f"HFModel was called with one tensor of shape {tuple(x.shape)}, read as the packed "
            f"input [B, 2T] (token ids, then their attention mask: pack_inputs(ids, mask)), but "
            f"its second half is not the mask of right-padded examples. Call the model with "
            f"keywords: model(input_ids=ids, attention_mask=mask), as a text dataset's batches "
            f"({{input_ids, attention_mask, labels}}) are.")
    return ids, mask


def _is_right_padded_mask(x: Tensor, mask: Tensor) -> bool:
    """Whether `mask` `[B, T]`, the second half of the packed `x`, can be an attention mask of
    right-padded examples: 0s and 1s, no 1 after a 0, and each row's first position a token
    (every example has one), except in rows of zeros only (the placeholder row of a fully sharded
    model's padding pass, dptrain.distributed.fsdp). Token ids passed alone rarely pass: their
    second half is read as the mask, and a pad id 0 there (BERT's [PAD]) fails the last rule."""
    placeholder = (x == 0).all(dim=1)
    return bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] <= mask[:, :-1]).all()
                and ((mask[:, 0] == 1) | placeholder).all())


class HFModel(nn.Module):
    """A Hugging Face (or PEFT) model as (input_ids, attention_mask) -> logits.

    `model` is the `transformers` model, or the `peft.PeftModel` around it with LoRA. Its
    `save_pretrained(folder)` writes what `from_pretrained` loads: the whole model after full
    fine-tuning, the adapters only (PEFT's format) with LoRA; the tokenizer goes with it.
    """

    def __init__(self, model: nn.Module, task: str, tokenizer: Any | None = None,
                 new_parameter_names: Sequence[str] = ()) -> None:
        super().__init__()
        if task not in TASKS:
            raise ConfigError(f"model.task={task!r} is not a task: use one of {', '.join(TASKS)}.")
        self.model, self.task, self.tokenizer = model, task, tokenizer
        # names (in `model.named_parameters()`) of the weights the checkpoint lacked: a new head
        self.new_parameter_names = tuple(new_parameter_names)

    def new_parameters(self) -> list[nn.Parameter]:
        """The parameters the checkpoint did not hold (a new classification head: BERT's
        `classifier`, RoBERTa's `classifier.dense` and `classifier.out_proj`, GPT-2's `score`, a
        PooledClassifier's `classifier`),
        in `model.named_parameters()` order; empty for a causal LM or a head the checkpoint
        held."""
        new = set(self.new_parameter_names)
        return [p for name, p in self.model.named_parameters() if name in new]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """`input_ids` and `attention_mask` `[B, T]` int64, right padded (a text dataset's batch:
        `model(input_ids=..., attention_mask=...)`) -> logits `[B, K]` or `[B, T', V]`, `T'` the
        longest sequence of the batch (at least 1). Called with one tensor, it is the packed
        `[B, 2T]` (ids then mask, `pack_inputs`) of dptrain 0.3, still accepted
        (`unpack_inputs` refuses ids without a mask)."""
        ids, mask = (unpack_inputs(input_ids) if attention_mask is None
                     else (input_ids, attention_mask))
        length = max(int(mask.sum(dim=1).max()), 1) if ids.shape[0] else ids.shape[1]
        return self.model(input_ids=ids[:, :length], attention_mask=mask[:, :length]).logits

    @property
    def is_lora(self) -> bool:
        """True when the model carries PEFT adapters."""
        return hasattr(self.model, "peft_config")

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, Any] | None = None) -> None:
        """The model (full) or its adapters (LoRA), and the tokenizer, in `folder`. `state_dict`:
        this wrapper's state dict to save instead of the live weights (a fully sharded model's,
        gathered whole: `dptrain.distributed.fsdp.model_state_dict`)."""
        inner = None if state_dict is None else {
            k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")}
        self.model.save_pretrained(str(folder), **({} if inner is None else {"state_dict": inner}))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(folder))


def parameter_groups(model: nn.Module, head_lr: float | None) -> list[dict[str, Any]]:
    """The trainable parameters of `model` as optimizer parameter groups: the new heads of the
    HFModels inside it (`HFModel.new_parameters`) at `head_lr`, everything else at the
    optimizer's own rate. One group (`[{"params": [...]}]`) when `head_lr` is None or nothing
    is new; else `[{"params": rest}, {"params": head, "lr": head_lr}]`.

    Discriminative fine-tuning: with Adam each weight moves by about its rate a step, however
    noisy its gradient, so a head started at zero grows at `head_lr` while the pretrained body
    moves at the optimizer's rate; until the head has grown, the body gets little gradient (the
    features' gradient is the head's weights times the error). On all-MiniLM-L6-v2 at epsilon 3 a
    head at 5 times the body's rate raised seeds 0-4 from 73-100 % to 91-100 % test accuracy
    (docs/transformers.md, "Defaults of model=hf"). A rate is post-processing: no privacy cost.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if head_lr is None:
        return [{"params": trainable}]
    new = {id(p) for m in model.modules() if isinstance(m, HFModel) for p in m.new_parameters()}
    head = [p for p in trainable if id(p) in new]
    if not head:
        warnings.warn(
            f"optimizer.head_lr={head_lr} is not used: the model has no new head (a "
            "classification head its checkpoint did not hold; a checkpoint's own head, LoRA's "
            "head, a causal LM and models other than model=hf have none), so every parameter "
            "trains at optimizer.lr. Set optimizer.head_lr=null to silence this.", stacklevel=2)
        return [{"params": trainable}]
    body = [p for p in trainable if id(p) not in new]
    return [*([{"params": body}] if body else []), {"params": head, "lr": float(head_lr)}]


# ----------------------------------------------------------------------------- losses
class CausalLMLoss(TokenLoss):
    """`dptrain.TokenLoss` (mean over samples of each sample's mean next-token cross-entropy over
    its own tokens) for logits `[B, T', V]` of a batch HFModel cut to `T' <= T`: the labels
    `[B, T]` (-100 at padding and prompt positions) are cut alike; their cut-off tail is all
    padding, so nothing counted is dropped. `per_sample`: each sample's loss `[B]`, what the
    loss step of a `{input_ids, attention_mask, labels}` batch averages."""

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return super().forward(logits, labels[:, : logits.shape[1]])

    def per_sample(self, logits: Tensor, labels: Tensor) -> Tensor:
        return super().per_sample(logits, labels[:, : logits.shape[1]])

    def token_sums(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return super().token_sums(logits, labels[:, : logits.shape[1]])


def loss_for_task(task: str | None) -> Callable[[Tensor, Tensor], Tensor]:
    """The per-sample-separable batch loss of `task` (mean over samples): cross-entropy for
    classification (and datasets that name no task), CausalLMLoss for causal_lm."""
    return CausalLMLoss(ignore_index=IGNORE_INDEX) if task == "causal_lm" else F.cross_entropy


def check_task(task: str, dataset_task: str, dataset: str) -> None:
    """ConfigError when the model's task does not fit the dataset's examples."""
    if task == dataset_task:
        return
    if task == "causal_lm":
        raise ConfigError(
            f"model.task=causal_lm but dataset={dataset} is a classification dataset (texts with "
            f"labels): a causal LM learns to continue texts. Use model.task=sequence_classification "
            f"for it, or a text-only dataset (dataset=text dataset.label_column=null, or "
            f"dataset=e2e_nlg)."
        )
    raise ConfigError(
        f"model.task={task} but dataset={dataset} has texts without labels (a causal LM "
        f"dataset): use model.task=causal_lm, or a dataset with a label column "
        f"(dataset.label_column=NAME)."
    )


# ----------------------------------------------------------------------------- LoRA, freezing
def matches_target(target: str, module_name: str) -> bool:
    """PEFT's rule for a list of target names: a module of that name or ending in `.target`."""
    return module_name == target or module_name.endswith(f".{target}")


def _layer_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the names of the model's Linear (and GPT-2 Conv1D) layers,
    which LoRA adapts; of every layer with weights when it has none."""
    def names(kinds: tuple[str, ...] | None) -> list[str]:
        found: list[str] = []
        for name, module in model.named_modules():
            last = name.rpartition(".")[2]
            wanted = type(module).__name__ in kinds if kinds else \
                getattr(module, "weight", None) is not None
            if name and wanted and last not in found and not last.isdigit():
                found.append(last)
        return found

    return names(("Linear", "Conv1D")) or names(None)


def lora_targets(model: nn.Module, settings: LoraConfig) -> list[str]:
    """The names of the modules that get adapters; ConfigError for a target matching none."""
    targets = settings.target_modules
    names = [name for name, _ in model.named_modules() if name]
    for target in targets:
        if not any(matches_target(target, name) for name in names):
            found = _layer_names(model)
            raise ConfigError(
                f"model.lora.target_modules: {target!r} matches no module of "
                f"{type(model).__name__}. Its layers are named e.g. "
                f"{', '.join(found[:MAX_LISTED])}{', ...' if len(found) > MAX_LISTED else ''}: "
                f"use those names (e.g. model.lora.target_modules=[query,value] for BERT and "
                f"RoBERTa, [c_attn] for GPT-2, [q_proj,v_proj] for Llama)."
            )
    return [name for name in names if any(matches_target(t, name) for t in targets)]


def add_lora(model: nn.Module, settings: LoraConfig, task: str) -> nn.Module:
    """`peft.get_peft_model(model, LoraConfig(...))`: adapters on the target modules (GPT-2's
    transposed Conv1D handled with `fan_in_fan_out`), everything else frozen but the task head."""
    try:
        import peft
    except ImportError as error:  # pragma: no cover - the test environment has it
        raise ConfigError("model.lora needs the peft package: pip install 'dptrain[hf]'.") from error
    matched = lora_targets(model, settings)
    modules = dict(model.named_modules())
    conv1d = {type(modules[name]).__name__ == "Conv1D" for name in matched}
    if len(conv1d) > 1:
        raise ConfigError(
            "model.lora.target_modules mixes Conv1D layers (GPT-2's, weights stored transposed) "
            "and Linear layers; LoRA handles one kind per model: target only one kind."
        )
    config = peft.LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        modules_to_save=list(settings.modules_to_save) or None,
        fan_in_fan_out=conv1d == {True}, task_type=PEFT_TASK_TYPES[task],
    )
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecated
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return peft.get_peft_model(model, config)


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Freeze (requires_grad=False) every parameter whose name matches one of the shell-style
    `patterns` (e.g. `*embeddings*`); the names frozen. ConfigError for a pattern matching
    no parameter, listing a few names."""
    names = [name for name, _ in model.named_parameters()]
    frozen: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(
                f"model.freeze: {pattern!r} matches no parameter name. Patterns are shell-style "
                f"(* matches anything) over names such as "
                f"{', '.join(names[:MAX_LISTED])}, ...; e.g. model.freeze=['*embeddings*']."
            )
        frozen += [n for n in hits if n not in frozen]
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return frozen


def zero_new_head(model: nn.Module, new_keys: Sequence[str], num_labels: int) -> list[str]:
    """Set to zero the new classification head's output layer: each `nn.Linear` of
    `num_labels` outputs whose weight the checkpoint did not hold (`new_keys`: the names
    `from_pretrained` reports missing or of a mismatched size). A head the checkpoint held is
    left as trained; a new head's hidden layers (RoBERTa's `classifier.dense`) keep their random
    initialisation, so the output layer's gradient is not zero. The names set to zero."""
    new = set(new_keys)
    zeroed: list[str] = []
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) and module.out_features == num_labels
                and f"{name}.weight" in new):
            with torch.no_grad():
                for parameter in module.parameters(recurse=False):
                    parameter.zero_()
            zeroed.append(name)
    return zeroed


# ----------------------------------------------------------------------------- quantization
def _import_bitsandbytes(quantize: str) -> None:
    """ConfigError saying how to install bitsandbytes when it is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"model.quantize={quantize} needs the bitsandbytes package, which stores the frozen "
            f"base in 8 or 4 bits (on CPU and CUDA): pip install 'dptrain[quantize]'. Or drop "
            f"model.quantize to keep the base in model.dtype."
        ) from error


def quantization_config(quantize: str, dtype: str, keep: Sequence[str] = ()) -> Any:
    """transformers' `BitsAndBytesConfig` of `model.quantize` (`int8` or `nf4`), the layers named
    by UNQUANTIZED_MODULES and `keep` left in `dtype`.

    int8 sets LLM.int8's outlier threshold to 0: with a threshold, the input columns computed in
    16 bits are those where ANY token of the batch exceeds it (bitsandbytes' int8 kernel: CUDA,
    and evaluation on CPU), so one example's activations would depend on the others in its
    batch and its clipped gradient would no longer bound its influence. At 0 each token's
    activations are quantized by their own absolute maximum (and on CPU training dequantizes
    the weights and runs a float matmul), so each example's forward pass is its own. nf4
    computes in `dtype` (QLoRA's compute dtype).
    """
    _import_bitsandbytes(quantize)
    transformers = import_transformers()
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_no_float16_notice)
    skip = [*UNQUANTIZED_MODULES, *keep]
    if quantize == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0,
                                               llm_int8_skip_modules=skip)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=getattr(torch, dtype),
        llm_int8_skip_modules=skip)


def _no_float16_notice(record: logging.LogRecord) -> bool:
    """False for bitsandbytes' notice that its int8 kernel casts the inputs to float16, which is
    how that kernel always computes (CUDA, and evaluation on CPU) and which every int8 layer
    logs on every call; its other records pass."""
    return "during quantization" not in record.getMessage()


def keep_training_layout(model: nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers in the layout that backpropagates: on a CPU with
    AVX512-BF16 a 4-bit layer evaluated without gradients repacks its weights for an
    inference-only kernel, through which no gradient reaches the layers before it (the adapters
    of earlier blocks would silently lose part of their gradient after the first evaluation)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def cast_adapters(model: nn.Module, dtype: str) -> None:
    """The LoRA adapters in `dtype`, upcast to float32 from 16 bits: what PEFT gives them over an
    unquantized base, where over a quantized one it leaves them in float32 (a float64 base's
    adapters would compute in float32). Heads keep `dtype`, as PEFT leaves them either way."""
    target = torch.float32 if dtype in ("bfloat16", "float16") else getattr(torch, dtype)
    for name, p in model.named_parameters():
        if p.requires_grad and ".lora_" in name and p.dtype != target:
            p.data = p.data.to(target)


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor once, with what quantized
    parameters keep beside their codes (bitsandbytes' per-row int8 scales `SCB`, the 4-bit
    blocks' absmax and code book): the memory a model's weights take, quantized or not."""
    seen: dict[tuple[int, torch.device], int] = {}

    def add(t: Tensor) -> None:
        seen[(t.data_ptr(), t.device)] = max(seen.get((t.data_ptr(), t.device), 0),
                                             t.numel() * t.element_size())

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        scales = getattr(t, "SCB", None)
        state = getattr(t, "quant_state", None)
        extra = [scales] if isinstance(scales, Tensor) else []
        if state is not None:
            extra += [v for v in state.as_dict(packed=True).values() if isinstance(v, Tensor)]
        for tensor in extra:
            add(tensor)
    return sum(seen.values())


# ----------------------------------------------------------------------------- building
def pooling_of(pooling: str, name_or_path: str, task: str, download: bool = False) -> str | None:
    """The pooling mode `build_hf_model` gives a classifier (`PooledClassifier`), or None for
    the transformers class's own head (`model.pooling=model`, a causal LM, or `auto` on a
    folder or hub id that declares no sentence-transformers pooling)."""
    if pooling not in (*POOLING_MODES, "auto", "model"):
        raise ConfigError(f"model.pooling={pooling!r} is not a pooling: use auto, model or one "
                          f"of {', '.join(POOLING_MODES)}.")
    if task != "sequence_classification":
        if pooling in POOLING_MODES:
            raise ConfigError(f"model.pooling={pooling} pools the texts for a classifier, but "
                              f"model.task={task}: a causal LM predicts every token and pools "
                              f"nothing. Leave model.pooling at auto (or model).")
        return None
    if pooling == "model":
        return None
    if pooling == "auto":
        read = local_reader(name_or_path) if is_local(name_or_path) else \
            _hub_reader(name_or_path, download)
        return sentence_pooling(read, name_or_path)
    return pooling


def _hub_reader(repo: str, download: bool) -> Callable[[str], str | None]:
    """`read` for `sentence_pooling` over a hub id's files: those in the Hugging Face cache, and
    when `download`, from the hub. An absent file, or one that cannot be fetched, is None (the
    model's own download then says what is wrong)."""
    import huggingface_hub

    def read(name: str) -> str | None:
        try:
            path = (huggingface_hub.hf_hub_download(repo, name) if download
                    else huggingface_hub.try_to_load_from_cache(repo, name))
        except Exception:  # noqa: BLE001 - no such file, no network: not a declared pooling
            return None
        return Path(path).read_text(encoding="utf-8") if isinstance(path, str) else None
    return read


def build_hf_model(
    name_or_path: str,
    task: str = "sequence_classification",
    num_labels: int | None = 2,
    dtype: str = "float32",
    freeze: Sequence[str] = (),
    lora: Mapping[str, Any] | LoraConfig | None = None,
    pad_token: str | None = None,
    download: bool = False,
    freeze_embeddings: bool = False,
    zero_init_head: bool = False,
    pooling: str = "auto",
    quantize: str | None = None,
    device: str | None = None,
) -> HFModel:
    """A pretrained model ready for `make_private`.

    Args:
        name_or_path: a folder written by `save_pretrained` (model and tokenizer), or a hub id.
        task: `sequence_classification` (a new head of `num_labels` outputs unless the
            checkpoint has one) or `causal_lm` (the LM head; `num_labels` unused).
        num_labels: classes of the classification head (null in the config: the dataset's).
        dtype: the parameters' dtype when loaded (`float32`, `bfloat16`, `float16`, `float64`);
            mixed precision is `hardware.precision=bf16` instead.
        freeze: shell-style patterns of parameter names kept frozen (applied after LoRA).
        lora: None for full fine-tuning, else the LoRA settings (`LoraConfig`, or a mapping of
            its fields).
        pad_token: a token of the tokenizer to pad with when it has none (GPT-2).
        download: allow downloading `name_or_path` from the hub.
        freeze_embeddings: keep the input token embeddings frozen (`get_input_embeddings()`;
            a causal LM whose output layer is tied to them keeps that fixed too).
        zero_init_head: start a new classification head's output layer at zero (`zero_new_head`),
            so that its first logits are 0 for every text instead of a random offset that the
            first noisy steps must undo (docs/transformers.md, "Defaults of model=hf").
        pooling: how a classifier turns the token states into one vector. `auto`: the pooling
            a sentence-transformers folder declares (`dptrain.models.hf_pooling`; the mean over
            the tokens for all-MiniLM-L6-v2), else the transformers class's own head; `model`:
            always the class's own head; or a mode of `hf_pooling.POOLING_MODES`.
        quantize: None (the base in `dtype`), `int8` or `nf4`: the frozen base's Linear layers
            stored in 8 or 4 bits by bitsandbytes (`quantization_config`), LoRA adapters
            (`lora`, required) trained over it in `dtype` (float32 from 16 bits).
        device: where a quantized model is loaded (the training device: bitsandbytes
            quantizes as it places the weights); None: the CPU. An unquantized model is
            always loaded on the CPU and moved by the caller.
    """
    transformers = import_transformers()
    if task not in TASKS:
        raise ConfigError(f"model.task={task!r} is not a task: use one of {', '.join(TASKS)}.")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not supported: use one of {', '.join(DTYPES)}.")
    lora_settings = None if lora is None else LoraConfig.of(lora)  # checked before any loading
    check_quantize(quantize, lora_settings, dtype)
    tokenizer = load_tokenizer(name_or_path, download=download, pad_token=pad_token)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if quantize is not None:
        kwargs["quantization_config"] = quantization_config(
            quantize, dtype, [] if lora_settings is None else lora_settings.modules_to_save)
        kwargs["device_map"] = {"": str(device or "cpu")}
    if task == "sequence_classification":
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 2:
            raise ConfigError(f"model.num_labels={num_labels!r} must be an integer >= 2 (or null: "
                              f"the dataset's number of classes).")
        kwargs.update(num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                      ignore_mismatched_sizes=True)  # a checkpoint's head of another size: new
        auto = transformers.AutoModelForSequenceClassification
    else:
        auto = transformers.AutoModelForCausalLM
    mode = pooling_of(pooling, name_or_path, task, download)
    if mode is not None:
        auto = transformers.AutoModel
        kwargs = {k: v for k, v in kwargs.items() if k in ("dtype", "quantization_config", "device_map")}
    with _no_progress_bars(not download, transformers):
        model, loading = from_pretrained(auto.from_pretrained, name_or_path, download=download,
                                         key="model.name_or_path", what="the model",
                                         output_loading_info=True, **kwargs)
    model.config.pad_token_id = tokenizer.pad_token_id
    new_keys = [*loading.get("missing_keys", ()),
                *(k[0] if isinstance(k, tuple) else k for k in loading.get("mismatched_keys", ()))]
    if mode is not None:
        model = PooledClassifier(model, mode, num_labels)
        new_keys = [] if model.load_head(name_or_path) else ["classifier.weight", "classifier.bias"]
    if zero_init_head and task == "sequence_classification":
        zero_new_head(model, new_keys, num_labels)
    if lora_settings is not None:
        model = add_lora(model, lora_settings, task)
        new_keys = []  # PEFT renames and wraps the head; its rate stays optimizer.lr
    if quantize is not None:
        keep_training_layout(model)
        cast_adapters(model, dtype)
    freeze_parameters(model, list(freeze or ()))
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    # from_pretrained leaves the model in eval mode
    return HFModel(model, task, tokenizer, new_parameter_names=sorted(new_keys)).train()
