"""Pretrained files from a local folder or the Hugging Face hub, and the tokenizer of one.

Where a model's or tokenizer's files come from (`is_local`, `from_pretrained`: a folder written by
`save_pretrained`, the hub cache, a download only when asked) and the tokenizer every text
dataset and `model=hf` share (`load_tokenizer`). Both `dptrain.models.hf` (the model) and
`dptrain.data.datasets.text` (the tokenised datasets) read these, so that the data part never
imports the models part. Torch-free: `transformers` is imported when a tokenizer is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError

# model.task's values, which a text dataset's `info["task"]` names too
TASKS = ("sequence_classification", "causal_lm")


def import_transformers() -> Any:
    """`transformers`, or a ConfigError saying how to install the [hf] extra."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - the test environment has it
        raise ConfigError(
            "model=hf needs the transformers and peft packages: pip install 'dptrain[hf]'."
        ) from error
    return transformers


def is_local(name_or_path: str) -> bool:
    """True when `name_or_path` names a folder on this machine (existing, or written as a path:
    `./x`, `../x`, `/x`, `~/x`) rather than a hub id such as `roberta-base` or `org/model`."""
    text = str(name_or_path)
    return Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or text.count("/") > 1


def from_pretrained(load: Callable[..., Any], name_or_path: str, *, download: bool, key: str,
                    what: str, **kwargs: Any) -> Any:
    """`load(name_or_path, **kwargs)` from a local folder or the hub cache; from the hub itself
    only when `download`. Every failure to find the files is a ConfigError naming `key`.

    Args:
        load: a `from_pretrained` (of an Auto class, a tokenizer or `PeftModel`).
        key: the config key that gave `name_or_path` (e.g. `model.name_or_path`).
        what: what is loaded, for the message (e.g. "the model", "the tokenizer").
    """
    if is_local(name_or_path):
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"{key}={name_or_path} is not a folder: point it at a folder written by "
                f"save_pretrained (config.json, the weights and the tokenizer files), or at a "
                f"Hugging Face hub id such as roberta-base."
            )
        try:
            return load(str(folder), **kwargs)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"{key}={name_or_path}: {what} cannot be loaded from this folder "
                f"({first_line(error)}). It must hold what save_pretrained writes (config.json, "
                f"model.safetensors; tokenizer.json or the tokenizer's vocabulary files)."
            ) from error
    try:
        return load(name_or_path, local_files_only=not download, **kwargs)
    except (OSError, ValueError) as error:
        if not download:
            raise ConfigError(
                f"{key}={name_or_path} is a Hugging Face hub id with no local copy (not a folder "
                f"here, not in the Hugging Face cache), and downloads are off. Add "
                f"dataset.download=true (it allows model.download too) on a machine with network "
                f"access, or point {key} at a folder saved with save_pretrained."
            ) from error
        raise ConfigError(
            f"{key}={name_or_path}: downloading {what} from the Hugging Face hub failed "
            f"({first_line(error)}). Check the hub id and the network (HF_ENDPOINT, HF_TOKEN "
            f"for gated models), or point {key} at a folder saved with save_pretrained."
        ) from error


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


# ----------------------------------------------------------------------------- tokenizer
# The files a saved tokenizer is read from (fast tokenizers, WordPiece, BPE, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _require_tokenizer_files(name_or_path: str, key: str) -> None:
    """ConfigError for a local folder that holds no tokenizer file: transformers would build a
    tokenizer of its few special tokens there, and every word would be trained as unknown."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}={name_or_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            f"without one every word would be read as the unknown token. Save the tokenizer "
            f"beside the weights (`tokenizer.save_pretrained(folder)`), or point {key} at a folder "
            f"or hub id that has it."
        )


def load_tokenizer(name_or_path: str, *, download: bool = False, pad_token: str | None = None,
                   key: str = "model.name_or_path") -> Any:
    """The tokenizer of `name_or_path` with a pad token, padding on the right.

    `pad_token` (e.g. GPT-2's `<|endoftext|>`) replaces the tokenizer's own, and must already be
    in its vocabulary (a new token would need a new embedding row). It may be a token with
    another role too: GPT-2's `<|endoftext|>` is its unknown, begin and end token at once, and a
    Llama's `</s>` its end token. Padding is told apart by the attention mask, never by the
    token id, so a real end token keeps its loss. Raises ConfigError for a tokenizer without a
    pad token, saying how to set one.
    """
    transformers = import_transformers()
    _require_tokenizer_files(name_or_path, key)
    tokenizer = from_pretrained(transformers.AutoTokenizer.from_pretrained, name_or_path,
                                download=download, key=key, what="the tokenizer")
    if pad_token is not None:
        # the vocabulary itself: an unknown token's id is the unknown token's (GPT-2: the end
        # token's), so the id alone cannot tell a token of the vocabulary from an unknown one
        if pad_token not in tokenizer.get_vocab():
            raise ConfigError(
                f"model.pad_token={pad_token!r} is not a token of the tokenizer of {key}="
                f"{name_or_path}: choose one of its tokens, e.g. its end-of-text token "
                f"{tokenizer.eos_token!r}."
            )
        tokenizer.pad_token = pad_token
    if tokenizer.pad_token_id is None:
        eos = tokenizer.eos_token
        # quoted for the shell and for Hydra's override grammar (`<|endoftext|>` needs quotes)
        example = f"""'model.pad_token="{eos}"'""" if eos else "model.pad_token=TOKEN"
        raise ConfigError(
            f"the tokenizer of {key}={name_or_path} has no pad token, needed to batch texts of "
            f"different lengths. Set one of its tokens as the pad token: {example} (the "
            f"end-of-text token, the usual choice for GPT-2 and Llama; padded positions are "
            f"masked out of attention and of the loss, so the choice does not change training)."
        )
    tokenizer.padding_side = "right"
    return tokenizer
