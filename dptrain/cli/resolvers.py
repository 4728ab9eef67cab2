"""OmegaConf resolvers the configs in dptrain/conf use; registered when this module is imported.

`dptrain.cli.main` (the command) and `dptrain.cli.build` (which resolves the config) import it,
so every `${...}` below resolves wherever dptrain builds a job:

* `${dptrain.token_ids:${dataset.vocab_size}}`: the number of token ids of a text dataset whose
  vocabulary has `vocab_size` words, i.e. vocab_size + the reserved ids (pad, start, unknown,
  unused: `dptrain.data.datasets.imdb.NUM_RESERVED`). Used by model/transformer.yaml.
* `${dptrain.finetune_lr:${oc.select:model.lora,null}}`: the learning rate model=hf fine-tunes
  with, LoRA adapters (`model.lora` set) or every parameter (null). Used by finetune/hf.yaml.
* `${dptrain.finetune_head_lr:${oc.select:model.lora,null},${model.task}}`: the learning rate
  of a new classification head in full fine-tuning (`optimizer.head_lr`), null (the head at
  `optimizer.lr`) with LoRA or for a causal LM. Used by finetune/hf.yaml.
* `${dptrain.finetune_grad_sample_mode:${oc.select:model.lora,null}}`: ghost clipping for full
  fine-tuning, hooks for LoRA (whose few trainable weights make per-sample gradients cheap).
  Used by privacy/finetune.yaml.
* `${dptrain.finetune_freeze_embeddings:${oc.select:model.lora,null},${model.task}}`: true for
  the full fine-tuning of a classifier (the token embeddings, about half of a small model's
  weights, stay as pretrained), false with LoRA or for a causal LM. Used by model/hf.yaml.
* `${dptrain.finetune_zero_init_head:${oc.select:model.lora,null},${model.task}}`: true for the
  full fine-tuning of a classifier (its new head's output layer starts at zero), false with LoRA
  or for a causal LM. Used by model/hf.yaml.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

# AdamW learning rates of model=hf, measured on all-MiniLM-L6-v2 at epsilon 3 (docs/transformers.md,
# "Defaults"): full fine-tuning at 2e-3, Li et al. 2022's rate for GPT-2 on E2E (at their
# classification rate, 5e-4, a new head hardly moved in the ~100 steps of a small data set: test
# loss 0.676-0.687 against 0.693 at chance, accuracy 50-93 % by seed); LoRA, whose few adapter weights
# start from zero, at 1e-2 (5e-4 to 5e-3 left it at chance on a few hundred examples)
FULL_FINETUNE_LR = 2.0e-3
# the new head of a fully fine-tuned classifier (optimizer.head_lr): started at zero, it grows by
# about its rate a step under Adam; at 1e-2, 5 times the body's rate, seeds 0-4 of all-MiniLM-L6-v2
# reached 91-100 % where one rate (2e-3) gave 73-100 %, and the body 1e-4 did worse (50, 65 %)
FULL_FINETUNE_HEAD_LR = 1.0e-2
LORA_LR = 1.0e-2


def token_ids(vocab_size: int) -> int:
    """`vocab_size` words + the dataset's reserved ids: the rows of a token embedding."""
    from dptrain.data.datasets.imdb import NUM_RESERVED  # lazy: `dptrain --help` loads no torch

    return int(vocab_size) + NUM_RESERVED


def finetune_lr(lora: Any) -> float:
    """The fine-tuning learning rate: LORA_LR with LoRA adapters (`lora` not null), else
    FULL_FINETUNE_LR."""
    return LORA_LR if lora is not None else FULL_FINETUNE_LR


def finetune_head_lr(lora: Any, task: str) -> float | None:
    """optimizer.head_lr for fine-tuning: FULL_FINETUNE_HEAD_LR for the full fine-tuning of a
    classifier (its pretrained body then trains at FULL_FINETUNE_LR), else None (one rate)."""
    return FULL_FINETUNE_HEAD_LR if _full_finetune_of_classifier(lora, task) else None


def finetune_grad_sample_mode(lora: Any) -> str:
    """privacy.grad_sample_mode for fine-tuning: hooks with LoRA adapters, else ghost."""
    return "hooks" if lora is not None else "ghost"


def _full_finetune_of_classifier(lora: Any, task: str) -> bool:
    """Every weight of a sequence classifier trains (no LoRA adapters)."""
    return lora is None and task == "sequence_classification"


def finetune_freeze_embeddings(lora: Any, task: str) -> bool:
    """model.freeze_embeddings for fine-tuning: true for the full fine-tuning of a classifier.

    Noise is added to every trained weight; the token embeddings are half of all-MiniLM-L6-v2's
    weights, and training them too left it at chance on a few hundred examples (5e-4, epsilon 3),
    while frozen it learned (docs/transformers.md, "Defaults of model=hf")."""
    return _full_finetune_of_classifier(lora, task)


def finetune_zero_init_head(lora: Any, task: str) -> bool:
    """model.zero_init_head for fine-tuning: true for the full fine-tuning of a classifier.

    A random new head adds to every text's logits an offset (its weights against the features
    all texts share) that can outweigh what separates the classes, so that every text gets the
    same label until training undoes it: on all-MiniLM-L6-v2 at lr 2e-3, one seed reached 73 %
    with a random head and 90 % with this one (docs/transformers.md, "Defaults of model=hf").
    Not measured with LoRA, which keeps PEFT's head."""
    return _full_finetune_of_classifier(lora, task)


OmegaConf.register_new_resolver("dptrain.token_ids", token_ids, replace=True)
OmegaConf.register_new_resolver("dptrain.finetune_freeze_embeddings", finetune_freeze_embeddings,
                                replace=True)
OmegaConf.register_new_resolver("dptrain.finetune_zero_init_head", finetune_zero_init_head,
                                replace=True)
OmegaConf.register_new_resolver("dptrain.finetune_lr", finetune_lr, replace=True)
OmegaConf.register_new_resolver("dptrain.finetune_head_lr", finetune_head_lr, replace=True)
OmegaConf.register_new_resolver("dptrain.finetune_grad_sample_mode", finetune_grad_sample_mode,
                                replace=True)
