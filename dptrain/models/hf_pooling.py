"""A classifier that reads a sentence-embedding checkpoint the way it was trained to be read.

A sentence-transformers checkpoint (all-MiniLM-L6-v2, all-mpnet-base-v2, the e5 and bge models
saved by sentence-transformers...) is a transformer body plus a `Pooling` module that turns its
token states into one vector: the mean over the text's tokens, most often. Its folder says so in
`modules.json` and `1_Pooling/config.json`. `AutoModelForSequenceClassification` ignores both and
classifies from BERT's pooler over the `[CLS]` token, which such a model was never trained to
fill: on all-MiniLM-L6-v2 those features are dominated by one direction that every text shares,
and a private head over them ended with every text on one label on some noise draws
(docs/transformers.md, "Defaults of model=hf").

`PooledClassifier` is the body (`AutoModel`), the checkpoint's own pooling and a linear head, and
`sentence_pooling(read, where)` reads which pooling a checkpoint declares (None: not a
sentence-transformers one). `save_pretrained` writes the body as `save_pretrained` does, the pooling files, and the
head in `classifier.safetensors`; `build_hf_model` loads such a folder back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
# each mode's flag in a sentence-transformers Pooling module's config.json
MODE_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
              "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}
HEAD_FILE = "classifier.safetensors"
POOLING_FILE = "pooling.json"           # dptrain's record of the pooling and the head's size


def sentence_pooling(read: Callable[[str], str | None], where: str) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (one of POOLING_MODES), from its
    `modules.json` and its Pooling module's `config.json`, or from a folder `PooledClassifier`
    saved (`pooling.json`); None for any other checkpoint (plain `save_pretrained`).

    Args:
        read: a file of the checkpoint by its path inside it -> the file's text, None if absent
            (`local_reader` for a folder; dptrain.models.hf reads a hub id's cached files).
        where: the checkpoint's name, for messages.
    Raises ConfigError for a pooling not implemented here (several modes at once, weighted-mean
    or last-token pooling).
    """
    saved = read(POOLING_FILE)
    if saved is not None:
        return json.loads(saved)["pooling"]
    modules = read("modules.json")
    pooling = [m for m in json.loads(modules or "[]")
               if str(m.get("type", "")).endswith("models.Pooling")]
    if not pooling:
        return None
    path = "/".join(part for part in (pooling[0].get("path", ""), "config.json") if part)
    config = json.loads(read(path) or "{}")
    flags = {key: config.get(key, False) for key in MODE_FLAGS.values()}
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in flags)
    chosen = [mode for mode, key in MODE_FLAGS.items() if flags[key]]
    if len(chosen) != 1 or others:
        raise ConfigError(
            f"model.name_or_path={where}: its sentence-transformers Pooling module ({path}) "
            f"sets {', '.join([*(MODE_FLAGS[m] for m in chosen), *others]) or 'no pooling mode'}; "
            f"dptrain implements one mode at a time of {', '.join(POOLING_MODES)}. Set "
            f"model.pooling to one of them, or to model (the transformers class's own head)."
        )
    return chosen[0]


def local_reader(folder: str | Path) -> Callable[[str], str | None]:
    """`read` for `sentence_pooling` over a folder on this machine."""
    def read(name: str) -> str | None:
        path = Path(folder).expanduser() / name
        return path.read_text(encoding="utf-8") if path.is_file() else None
    return read


def pool(states: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Token states `[B, T, H]` and attention mask `[B, T]` (1 = a token of the text) -> one
    vector per text `[B, H]`: the mean, the mean times sqrt(length), or the maximum over the
    text's own tokens, or the first token's state (`cls`). Padding never counts."""
    if mode == "cls":
        return states[:, 0]
    keep = mask.unsqueeze(-1).to(states.dtype)
    if mode == "max":
        return states.masked_fill(keep == 0, torch.finfo(states.dtype).min).amax(dim=1)
    length = keep.sum(dim=1).clamp(min=1)
    total = (states * keep).sum(dim=1)
    return total / length if mode == "mean" else total / length.sqrt()


class PooledClassifier(nn.Module):
    """`body` (a `transformers` base model) -> `pool(last_hidden_state, mask, pooling)` ->
    dropout -> `classifier` (`nn.Linear(hidden, num_labels)`). Called as a `transformers`
    classifier (`input_ids=`, `attention_mask=`, optional `labels=`; other keywords that PEFT
    passes are ignored) and answers with an object holding `.logits` `[B, num_labels]` (and
    `.loss` with labels), so that a `transformers.Trainer` can train and evaluate it."""

    def __init__(self, body: nn.Module, pooling: str, num_labels: int) -> None:
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ConfigError(f"PooledClassifier(pooling={pooling!r}): not a pooling mode; use "
                              f"one of {', '.join(POOLING_MODES)}.")
        if getattr(body, "pooler", None) is not None:
            body.pooler = None  # BERT's pooler over [CLS]: unused here, it would only get noise
        self.body, self.pooling = body, pooling
        self.config = body.config       # what PEFT and save_pretrained's callers read
        config = body.config
        rate = getattr(config, "classifier_dropout", None)
        rate = getattr(config, "hidden_dropout_prob", 0.0) if rate is None else rate
        self.dropout = nn.Dropout(rate)
        self.classifier = nn.Linear(config.hidden_size, num_labels, dtype=body.dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None,
                **_: Any) -> Any:
        """`input_ids`, `attention_mask` `[B, T]` -> `.logits` `[B, num_labels]`, and `.loss`,
        the batch's mean cross-entropy, when `labels` `[B]` are given (as a `transformers`
        classifier: the Trainer evaluates with it and finds its label column by this argument;
        a private run's training loss is per example, computed outside)."""
        from transformers.modeling_outputs import SequenceClassifierOutput
        states = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = pool(states, attention_mask, self.pooling)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def get_input_embeddings(self) -> nn.Module:
        return self.body.get_input_embeddings()

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, Tensor] | None = None,
                        **kwargs: Any) -> None:
        """The body as its `save_pretrained` writes it, the head in `classifier.safetensors` and
        the pooling in `pooling.json`: what `build_hf_model(folder)` loads back."""
        from safetensors.torch import save_file
        state = self.state_dict() if state_dict is None else state_dict
        body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
        head = {k.removeprefix("classifier."): v.detach().contiguous()
                for k, v in state.items() if k.startswith("classifier.")}
        self.body.save_pretrained(str(folder), state_dict=body, **kwargs)
        save_file(head, str(Path(folder) / HEAD_FILE))
        (Path(folder) / POOLING_FILE).write_text(json.dumps(
            {"pooling": self.pooling, "num_labels": self.classifier.out_features}, indent=2))

    def load_head(self, folder: str | Path) -> bool:
        """The head saved in `folder` by save_pretrained, when there is one of this size (True)."""
        from safetensors.torch import load_file
        path = Path(folder).expanduser() / HEAD_FILE
        if not path.is_file():
            return False
        head = load_file(str(path))
        if tuple(head["weight"].shape) != tuple(self.classifier.weight.shape):
            return False
        self.classifier.load_state_dict(head)
        return True
