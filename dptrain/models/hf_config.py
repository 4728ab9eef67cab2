"""The settings of `model=hf` that need no torch: the tasks, the dtypes, the LoRA settings and
the quantization of a frozen base (`model.quantize`, QLoRA).

Torch-free, so that the command's typed configs (dptrain.cli.schema uses `LoraConfig` as the
schema of `model.lora`) load without torch; `dptrain.models.hf` builds the model from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, List

from dptrain.checks import POSITIVE_INT, POSITIVE_NUMBER, Rule, check_fields, is_real, setting
from dptrain.errors import ConfigError
from dptrain.pretrained import TASKS  # noqa: F401  (model.task's values)
DTYPES = ("float32", "bfloat16", "float16", "float64")
PEFT_TASK_TYPES = {"sequence_classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}
# model.quantize: the frozen base's Linear weights in 8 bits (bitsandbytes' LLM.int8 format,
# transformers' load_in_8bit) or 4 bits (QLoRA's NormalFloat, load_in_4bit with quant type nf4)
QUANTIZE = ("int8", "nf4")
# the dtypes bitsandbytes quantizes to 4 bits and computes in: its 4-bit quantizer refuses
# float64, and its CPU 4-bit matmul in float64 returns wrong values (measured, 0.50.2)
NF4_DTYPES = ("float32", "bfloat16", "float16")

NAMES = Rule("a list of module names (strings)",  # any sequence: a config's list is no `list`
             lambda v: isinstance(v, Sequence) and not isinstance(v, str)
             and all(isinstance(x, str) for x in v))
DROPOUT = Rule("a number in [0, 1)", lambda v: is_real(v) and 0 <= v < 1)


@dataclass
class LoraConfig:
    """`model.lora`: adapters of rank `r` scaled by `alpha / r` on the layers named by
    `target_modules` (a module matches a name when its own name is that name or ends with
    `.name`, PEFT's rule), dropout on their input; `modules_to_save` are trained whole (PEFT adds
    the classifier head itself for sequence classification). Checked on construction."""

    r: int = setting(8, POSITIVE_INT)
    alpha: float = setting(16.0, POSITIVE_NUMBER)
    dropout: float = setting(0.0, DROPOUT)
    target_modules: List[str] = setting(["query", "value"], NAMES)
    modules_to_save: List[str] = setting([], NAMES)

    def __post_init__(self) -> None:
        check_fields(self, LoraConfig, "model.lora")
        if not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name the layers that get "
                              "adapters, e.g. [query,value] (BERT, RoBERTa) or [c_attn] (GPT-2).")
        self.target_modules, self.modules_to_save = list(self.target_modules), list(self.modules_to_save)

    @classmethod
    def of(cls, options: Mapping[str, Any] | LoraConfig) -> LoraConfig:
        """The settings of a `model.lora` mapping (missing keys: the defaults above)."""
        if isinstance(options, LoraConfig):
            return options
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"model.lora.{unknown[0]} is not a LoRA setting: use "
                              f"{', '.join(known)}.")
        return cls(**dict(options))


def check_quantize(quantize: str | None, lora: object, dtype: str) -> None:
    """ConfigError unless `model.quantize` (None, or one of QUANTIZE) fits the other settings.

    A quantized base is frozen: its weights are integers that no gradient step can change, so
    only LoRA adapters (`lora` not None) train over it; full fine-tuning is refused rather than
    silently training the few unquantized parameters. 4-bit weights need a 16- or 32-bit dtype
    (NF4_DTYPES)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise ConfigError(f"model.quantize={quantize!r} is not a quantization: use null (the "
                          f"base in model.dtype), {' or '.join(QUANTIZE)}.")
    if lora is None:
        raise ConfigError(
            f"model.quantize={quantize} needs model.lora: a quantized base is frozen (its "
            f"weights are {quantize} codes no gradient step can change), so it cannot be fine-"
            f"tuned fully, privately or not. Add LoRA adapters, e.g. "
            f"model.lora='{{r:8,alpha:16,target_modules:[q_proj,v_proj]}}', or drop "
            f"model.quantize to fine-tune every parameter.")
    if quantize == "nf4" and dtype not in NF4_DTYPES:
        raise ConfigError(
            f"model.quantize=nf4 with model.dtype={dtype}: bitsandbytes quantizes to 4 bits and "
            f"computes only in {', '.join(NF4_DTYPES)}. Use model.dtype=float32 (or bfloat16), "
            f"or model.quantize=int8, which computes in float64 too.")
