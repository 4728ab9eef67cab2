"""Tiny random-init Hugging Face models with tokenizers in the real formats, saved to a folder
(no tests here).

`save_tiny(folder, kind)` writes what `save_pretrained` writes for a real checkpoint (config,
weights, tokenizer), so the code under test loads it exactly as it would load `roberta-base`,
`gpt2` or a Llama from the hub, with no download. Each tokenizer is the real class built from
the real kind of vocabulary files, small, with the real special-token layout:

* "bert": `BertTokenizerFast` from a WordPiece vocab.txt; [PAD] [UNK] [CLS] [SEP] [MASK];
  a sequence classifier.
* "roberta": `RobertaTokenizerFast` from a byte-level BPE vocab.json + merges.txt; <s> <pad> </s>
  <unk> first, <mask> last; a sequence classifier (positions start after the pad id).
* "gpt2": `GPT2TokenizerFast` from a byte-level BPE vocab.json + merges.txt whose one special
  token, `<|endoftext|>` (the last id), is the unknown, begin and end token, and no pad token
  (`pad=True`: `<|endoftext|>` saved as the pad token too, as `tokenizer.pad_token =
  tokenizer.eos_token` then `save_pretrained` does); a causal LM.
* "llama": `LlamaTokenizerFast` from a byte-fallback BPE (`▁` for spaces) with <unk> <s> </s>
  (ids 0, 1, 2) and the 256 byte tokens, <s> added in front of each text, no pad token; a causal LM.

The BPE vocabularies are trained with the `tokenizers` library on the words of `WORDS` (which
include the synthetic sentences' words), so every such word is one token, with or without a
space in front, and no test text is unknown.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from dptrain.data.datasets.text import SYNTHETIC_WORDS

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("peft")

WORDS = tuple(dict.fromkeys([*SYNTHETIC_WORDS, "i", "liked", "it", "hated", "this", "not",
                             "name", "eattype", "pub", "area", "is", "in", "serves", "and"]))
WIDTH, LAYERS, HEADS, MAX_POSITIONS = 16, 2, 2, 64
KINDS = ("bert", "roberta", "gpt2", "llama")
CAUSAL_KINDS = ("gpt2", "llama")
GPT2_END = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]


# ----------------------------------------------------------------------------- vocabularies
def _corpus() -> list[str]:
    """Each word alone (no space in front) and all words in two lines, forwards and backwards
    (so that each has a space in front once)."""
    return [*WORDS, " ".join(WORDS), " ".join(reversed(WORDS))]


def _trained_bpe(pre_tokenizer: Any, specials: list[str], **bpe: Any) -> tuple[dict[str, int], list[str]]:
    """(vocab, merges "a b") of a BPE trained on `_corpus()` until every word is one token,
    `specials` first, then the initial alphabet and the merged tokens."""
    from tokenizers import Tokenizer, models, trainers

    core = Tokenizer(models.BPE(**bpe))
    core.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizer.alphabet() if hasattr(pre_tokenizer, "alphabet") else []
    core.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=100_000, min_frequency=1, special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False))
    model = json.loads(core.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _write_bpe_files(folder: Path, vocab: dict[str, int], merges: list[str]) -> tuple[str, str]:
    """vocab.json and merges.txt (GPT-2's format) in `folder`; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def byte_level_tokenizer(folder: Path, kind: str) -> Any:
    """GPT-2's (`kind="gpt2"`) or RoBERTa's tokenizer from vocab.json + merges.txt in `folder`."""
    from tokenizers import pre_tokenizers

    specials = ROBERTA_SPECIALS if kind == "roberta" else []
    vocab, merges = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), specials)
    last = GPT2_END if kind == "gpt2" else "<mask>"
    vocab[last] = len(vocab)
    files = _write_bpe_files(folder, vocab, merges)
    if kind == "gpt2":  # unk = bos = eos = <|endoftext|>, no pad: the class's defaults
        return transformers.GPT2TokenizerFast(*files)
    return transformers.RobertaTokenizerFast(*files)


def bert_tokenizer(folder: Path, words: tuple[str, ...] = WORDS, cased: bool = False) -> Any:
    """BERT's WordPiece tokenizer from a vocab.txt of the specials then `words` in `folder`:
    uncased (lower-cases its input, as bert-base-uncased) or `cased` (as bert-base-cased)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join([*BERT_SPECIALS, *words]) + "\n", encoding="utf-8")
    return transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=not cased)


def llama_tokenizer() -> Any:
    """Llama's tokenizer (byte-fallback BPE, <s> in front of each text) over a trained vocabulary."""
    from tokenizers import pre_tokenizers

    vocab, merges = _trained_bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                                 LLAMA_SPECIALS, unk_token="<unk>", byte_fallback=True)
    return transformers.LlamaTokenizerFast(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                           add_bos_token=True, add_eos_token=False)


def build_tokenizer(folder: Path, kind: str, pad: bool = False) -> Any:
    """The tokenizer of `kind` (its vocabulary files written to `folder` where it has some)."""
    if kind == "bert":
        return bert_tokenizer(folder)
    if kind == "llama":
        return llama_tokenizer()
    tokenizer = byte_level_tokenizer(folder, kind)
    if kind == "gpt2" and pad:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----------------------------------------------------------------------------- models
def _model(kind: str, tokenizer: Any, dropout: float) -> Any:
    """A random-init model of `kind` over the tokenizer's vocabulary, every dropout `dropout`."""
    t = transformers
    tokens = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **tokens))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS,
            max_position_embeddings=MAX_POSITIONS, attention_dropout=dropout, **tokens))
    common = dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=2 * WIDTH, num_labels=2, hidden_dropout_prob=dropout,
                  attention_probs_dropout_prob=dropout, **tokens)
    if kind == "roberta":  # positions start after the pad id
        return t.RobertaForSequenceClassification(
            t.RobertaConfig(max_position_embeddings=MAX_POSITIONS + 2, **common))
    return t.BertForSequenceClassification(t.BertConfig(max_position_embeddings=MAX_POSITIONS, **common))


def save_tiny(folder: Path, kind: str, pad: bool = False, seed: int = 0, dropout: float = 0.1) -> Path:
    """A tiny random-init `kind` model (one of KINDS) and its tokenizer saved in `folder`;
    returns `folder`. `dropout=0` for a deterministic training forward (per-sample gradient
    checks)."""
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(Path(folder), kind, pad)
    _model(kind, tokenizer, dropout).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def save_tiny_mixtral(folder: Path, seed: int = 0) -> Path:
    """A tiny random-init Mixtral causal LM (4 experts, top-2, widths multiple of 16 bytes as the
    default `grouped_mm` experts kernel needs) with Llama's tokenizer, saved in `folder`; no pad
    token (pass `model.pad_token="</s>"`). Returns `folder`."""
    import torch

    torch.manual_seed(seed)
    tokenizer = llama_tokenizer()
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def save_sentence_transformer(folder: Path, pooling: dict[str, bool] | None = None, seed: int = 0,
                              dropout: float = 0.0) -> Path:
    """A tiny BERT saved as sentence-transformers saves one: the base `BertModel` and its
    tokenizer at the top, `modules.json` naming Transformer, Pooling and Normalize modules, the
    Pooling module's `1_Pooling/config.json` (`pooling`: its `pooling_mode_*` flags; default
    the mean over the tokens, as all-MiniLM-L6-v2) and an empty `2_Normalize/`. Returns `folder`."""
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(Path(folder), "bert")
    _model("bert", tokenizer, dropout).bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             **(pooling or {})}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    (Path(folder) / "modules.json").write_text(json.dumps(modules, indent=2))
    (Path(folder) / "1_Pooling").mkdir()
    (Path(folder) / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": WIDTH, **modes}, indent=2))
    (Path(folder) / "2_Normalize").mkdir()
    return Path(folder)


# ----------------------------------------------------------------------------- data files
def write_csv(path: Path, rows: list[dict[str, object]]) -> Path:
    """`rows` (dicts with the same keys) as a CSV file with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def review_rows(count: int) -> list[dict[str, object]]:
    """`count` short labelled reviews (label 1 for liked, 0 for hated), deterministic."""
    good = ["i liked it", "a great film", "brilliant acting", "a moving story", "funny and strong"]
    bad = ["i hated it", "a bad movie", "boring plot", "a dull slow ending", "weak acting"]
    return [{"review": (good if i % 2 else bad)[i % 5], "label": i % 2} for i in range(count)]


def e2e_rows(count: int) -> list[dict[str, object]]:
    """`count` (meaning representation, reference) pairs in E2E's style."""
    foods = ["coffee", "food", "music"]
    return [{"mr": f"name the pub area riverside serves {foods[i % 3]}",
             "ref": f"the pub is in the riverside area and serves cheap {foods[i % 3]}"}
            for i in range(count)]


# ----------------------------------------------------------------------------- other families
GEMMA_FAMILIES = ("gemma2", "gemma3")


def save_tiny_gemma(folder: Path, family: str, task: str = "causal_lm", seed: int = 0) -> Path:
    """A tiny random-init Gemma 2 or Gemma 3 (text) model saved in `folder` with Llama's tokenizer
    format (byte-fallback BPE, as Gemma's own; `</s>` to pad with: 'model.pad_token="</s>"'):
    a causal LM (`task="causal_lm"`, the LM head tied to the scaled word embedding) or a sequence
    classifier (`task="sequence_classification"`). Layer 0 slides, layer 1 attends fully; dropout
    0 (Gemma's default). Returns `folder`."""
    import torch

    torch.manual_seed(seed)
    tokenizer = llama_tokenizer()
    t = transformers
    config_cls = t.Gemma2Config if family == "gemma2" else t.Gemma3TextConfig
    config = config_cls(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
                        head_dim=WIDTH // HEADS, query_pre_attn_scalar=WIDTH // HEADS,
                        max_position_embeddings=MAX_POSITIONS, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], num_labels=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if task == "causal_lm":
        cls = t.Gemma2ForCausalLM if family == "gemma2" else t.Gemma3ForCausalLM
    else:
        cls = t.Gemma2ForSequenceClassification if family == "gemma2" else t.Gemma3TextForSequenceClassification
    cls(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
