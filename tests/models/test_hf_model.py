"""model=hf: pretrained Hugging Face models built from a folder, full, frozen or with LoRA.

Tiny random-init models saved with save_pretrained (tests/hf_tiny.py) stand in for hub models.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from dptrain.errors import ConfigError
from dptrain.losses import per_sample_token_losses, token_loss
from dptrain.models.hf import (
    CausalLMLoss,
    HFModel,
    build_hf_model,
    check_task,
    load_tokenizer,
    loss_for_task,
    pack_inputs,
    parameter_groups,
    unpack_inputs,
)
from tests.hf_tiny import CAUSAL_KINDS, KINDS, save_tiny

GPT2_PAD = "<|endoftext|>"
#: the pad token of each kind: its own (BERT, RoBERTa), else its end token (as users set it)
PAD_TOKENS = {"bert": None, "roberta": None, "gpt2": "<|endoftext|>", "llama": "</s>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny(root / kind, kind, dropout=0.0) for kind in KINDS}


def _batch(model: HFModel, texts: list[str], max_len: int) -> torch.Tensor:
    """`[B, 2 max_len]` (ids, mask) as the text datasets store them."""
    encoded = model.tokenizer(texts, max_length=max_len, truncation=True, padding="max_length",
                              return_tensors="pt")
    return pack_inputs(encoded["input_ids"], encoded["attention_mask"])


def _lm_labels(x: torch.Tensor) -> torch.Tensor:
    """The ids of a packed batch, -100 at padding."""
    ids, mask = unpack_inputs(x)
    return ids.masked_fill(mask == 0, -100)


def test_classifier_gives_one_row_of_num_labels_logits_per_text(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), num_labels=3)
    assert model(_batch(model, ["i liked it", "a bad movie"], 8)).shape == (2, 3)


def test_padding_beyond_the_longest_text_does_not_change_the_logits(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), dtype="float64").eval()
    texts = ["i liked it", "a dull slow ending"]
    torch.testing.assert_close(model(_batch(model, texts, 8)), model(_batch(model, texts, 30)))


def test_causal_lm_loss_of_the_cut_batch_is_the_token_loss_of_the_full_one(
        folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["gpt2"]), task="causal_lm", pad_token=GPT2_PAD,
                           dtype="float64").eval()
    x = _batch(model, ["the pub is in the riverside area", "cheap food"], 16)
    labels = _lm_labels(x)
    full = model.model(input_ids=unpack_inputs(x)[0], attention_mask=unpack_inputs(x)[1]).logits
    assert model(x).shape[1] == 7  # cut to the longest text
    torch.testing.assert_close(CausalLMLoss()(model(x), labels), token_loss(full, labels))


def test_lora_trains_only_the_adapters_and_the_classifier_head(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), lora={"r": 2, "target_modules": ["query", "value"]})
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "classifier" in n for n in trained)
    assert any("classifier" in n for n in trained)


def test_perplexity_sums_count_every_text_token_once(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["gpt2"]), task="causal_lm", pad_token=GPT2_PAD,
                           dtype="float64").eval()
    x = _batch(model, ["the pub is in the riverside area", "cheap food"], 16)
    labels = _lm_labels(x)
    logits = model(x)
    nll, tokens = CausalLMLoss().token_sums(logits, labels)
    by_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:7],
                                                 reduction="sum")
    assert int(tokens) == (7 - 1) + (2 - 1)
    torch.testing.assert_close(nll, by_token)


def test_lora_on_gpt2_conv1d_layers_sets_fan_in_fan_out(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["gpt2"]), task="causal_lm", pad_token=GPT2_PAD,
                           lora={"r": 2, "target_modules": ["c_attn"]})
    assert model.model.peft_config["default"].fan_in_fan_out


def test_freeze_patterns_keep_matching_parameters_frozen(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), freeze=["*embeddings*"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all("embeddings" in n for n in frozen)
    assert any(p.requires_grad for n, p in model.named_parameters() if "encoder" in n)


def test_save_pretrained_of_lora_writes_adapters_that_peft_loads(folders: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    import peft
    import transformers

    model = build_hf_model(str(folders["bert"]), lora={"r": 2, "target_modules": ["query"]})
    torch.nn.init.normal_(next(p for n, p in model.named_parameters() if "lora_B" in n))
    model.save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(folders["bert"]))
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    x = _batch(model, ["i liked it"], 6)
    ids, mask = unpack_inputs(x)
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, model.eval()(x))


@pytest.mark.parametrize("kind, head", [("bert", "classifier"), ("roberta", "classifier.out_proj"),
                                        ("gpt2", "score")])
def test_parameter_groups_put_a_new_head_at_head_lr_and_the_body_at_the_optimizers_rate(
        folders: dict[str, Path], kind: str, head: str) -> None:
    pad = {"pad_token": PAD_TOKENS[kind]} if PAD_TOKENS[kind] else {}
    model = build_hf_model(str(folders[kind]), num_labels=3, freeze_embeddings=True, **pad)
    optimizer = torch.optim.AdamW(parameter_groups(model, head_lr=0.5), lr=1e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    body, new = ({names[id(p)] for p in g["params"]} for g in optimizer.param_groups)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-4, 0.5]
    # the layers the checkpoint lacks (its RoBERTa head has 2 labels: classifier.dense is kept)
    assert new and all(n.startswith(f"model.{head}.") for n in new)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert body == trainable - new and not any(n.startswith(f"model.{head}.") for n in body)


def test_parameter_groups_are_one_group_without_head_lr_or_a_new_head(
        folders: dict[str, Path]) -> None:
    new_head = build_hf_model(str(folders["bert"]), num_labels=3)
    saved_head = build_hf_model(str(folders["bert"]), num_labels=2)  # the checkpoint's own
    lora = build_hf_model(str(folders["bert"]), num_labels=3, lora={"target_modules": ["query"]})
    for model, head_lr in ((new_head, None), (saved_head, 0.5), (lora, 0.5)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            groups = parameter_groups(model, head_lr)
        assert len(groups) == 1 and "lr" not in groups[0]
        assert groups[0]["params"] == [p for p in model.parameters() if p.requires_grad]


def test_a_head_lr_with_no_new_head_to_use_it_is_a_warning_naming_the_key(
        folders: dict[str, Path]) -> None:
    saved_head = build_hf_model(str(folders["bert"]), num_labels=2)  # the checkpoint's own
    with pytest.warns(UserWarning, match=r"optimizer.head_lr=0.5 is not used: the model has no new head"):
        parameter_groups(saved_head, 0.5)
    with pytest.warns(UserWarning, match="optimizer.head_lr=0.5 is not used"):
        parameter_groups(torch.nn.Linear(2, 2), 0.5)


# ----------------------------------------------------------------------------- bad input
def test_hub_id_without_a_local_copy_is_refused_unless_downloads_are_on() -> None:
    with pytest.raises(ConfigError, match=r"model.name_or_path=no-such-org/no-such-model .*"
                                          r"dataset.download=true"):
        build_hf_model("no-such-org/no-such-model")


def test_missing_local_folder_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.name_or_path=.* is not a folder"):
        build_hf_model(str(tmp_path / "absent"))


def test_tokenizer_without_pad_token_is_refused_saying_how_to_set_one(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"""no pad token.*'model.pad_token="<\|endoftext\|>"'"""):
        build_hf_model(str(folders["gpt2"]), task="causal_lm")


def test_lora_target_matching_no_module_lists_the_layer_names(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"'q_proj' matches no module.*query, key, value"):
        build_hf_model(str(folders["bert"]), lora={"target_modules": ["query", "q_proj"]})


def test_freeze_embeddings_keeps_only_the_input_token_embeddings_frozen(
        folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), num_labels=2, freeze_embeddings=True)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.bert.embeddings.word_embeddings.weight"}


@pytest.mark.parametrize("kind, head", [("bert", "classifier"), ("roberta", "classifier.out_proj"),
                                        ("gpt2", "score")])
def test_zero_init_head_starts_only_a_new_heads_output_layer_at_zero(
        folders: dict[str, Path], kind: str, head: str) -> None:
    pad = {"pad_token": PAD_TOKENS[kind]} if PAD_TOKENS[kind] else {}
    model = build_hf_model(str(folders[kind]), num_labels=3, zero_init_head=True, **pad)
    random = build_hf_model(str(folders[kind]), num_labels=3, **pad)
    prefix = f"model.{head}."
    for (name, p), (_, q) in zip(model.named_parameters(), random.named_parameters()):
        if name.startswith(prefix):  # (a random head's bias starts at 0 too)
            assert not p.any() and (q.any() or name.endswith("bias")), name
        else:
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert not model(_batch(model, ["i liked it", "a bad movie"], 8)).any()  # logits all 0


def test_zero_init_head_keeps_a_head_the_checkpoint_holds(folders: dict[str, Path]) -> None:
    model = build_hf_model(str(folders["bert"]), num_labels=2, zero_init_head=True)
    assert model.model.classifier.weight.abs().min() > 0  # the saved (trained) head


def test_freeze_pattern_matching_no_parameter_is_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"model.freeze: '\*embedings\*' matches no parameter"):
        build_hf_model(str(folders["bert"]), freeze=["*embedings*"])


def test_causal_lm_with_a_classification_dataset_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.task=causal_lm but dataset=glue_sst2 is a "
                                          "classification dataset"):
        check_task("causal_lm", "sequence_classification", "glue_sst2")


@pytest.mark.parametrize("kind, lora", [("bert", None), ("gpt2", {"r": 2, "target_modules": ["c_attn"]})])
def test_per_sample_gradients_of_cut_batches_equal_each_text_alone(folders: dict[str, Path], kind: str,
                                                                   lora: dict | None) -> None:
    from dptrain import check_per_sample_gradients
    from dptrain.models.hf import loss_for_task

    task = "causal_lm" if kind == "gpt2" else "sequence_classification"
    model = build_hf_model(str(folders[kind]), task=task, lora=lora, dtype="float64",
                           pad_token=GPT2_PAD if kind == "gpt2" else None)
    torch.manual_seed(0)
    for p in model.parameters():  # adapters and heads away from their zero initialisation
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    x = _batch(model, ["i liked it", "a dull slow ending of the film", "bad"], 12)
    y = _lm_labels(x) if kind == "gpt2" else torch.tensor([1, 0, 0])
    errors = check_per_sample_gradients(model, x, y, loss_for_task(task))
    assert errors and max(errors.values()) < 1e-10


def test_a_batch_of_two_full_length_texts_keeps_its_batch_dimension(folders: dict[str, Path]) -> None:
    """Two examples of T tokens: the ids [2, T] inside the model must not be taken for one example
    of the input shared by the batch (the old [B, 2, T] layout had examples of shape [2, T])."""
    from dptrain.grad_sample.module import GradSampleModule

    model = build_hf_model(str(folders["gpt2"]), task="causal_lm", pad_token=GPT2_PAD)
    x = _batch(model, ["the pub is in the riverside area and serves cheap food"] * 2, 6)
    assert int(unpack_inputs(x)[1].sum(dim=1).min()) == 6  # no padding: nothing is cut
    wrapped = GradSampleModule(model)
    assert wrapped(x).shape[:2] == (2, 6)


# ----------------------------------------------------------------------------- tokenizer conventions
def test_the_real_gpt2_layout_loads_with_the_pad_token_dptrain_suggests(folders: dict[str, Path]) -> None:
    """GPT-2's one special token <|endoftext|> is its unknown, begin and end token, and it has no
    pad token: the pad token the refusal suggests must then be accepted."""
    with pytest.raises(ConfigError) as refusal:
        load_tokenizer(str(folders["gpt2"]))
    suggested = re.search(r'model\.pad_token="([^"]+)"', str(refusal.value)).group(1)
    tokenizer = load_tokenizer(str(folders["gpt2"]), pad_token=suggested)
    assert suggested == GPT2_PAD
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == tokenizer.unk_token_id


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_pad_token_outside_the_vocabulary_is_refused_naming_the_end_token(
        folders: dict[str, Path], kind: str) -> None:
    end = "<|endoftext|>" if kind == "gpt2" else "</s>"
    with pytest.raises(ConfigError, match=rf"model.pad_token='<pad>' is not a token .* its "
                                          rf"end-of-text token '{re.escape(end)}'"):
        load_tokenizer(str(folders[kind]), pad_token="<pad>")


def _encoded(tokenizer: object, task: str, texts: list[str], max_len: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs `[B, 2 max_len]`, labels) as the text datasets make them: class 1 for each text,
    or the causal LM rows `[bos] text [eos]` with their labels."""
    from dptrain.data.datasets.text import encode_causal_lm, encode_classification

    if task == "causal_lm":
        x, y = encode_causal_lm(tokenizer, [(None, text) for text in texts], max_len)
        return x.long(), y
    return encode_classification(tokenizer, texts, max_len).long(), torch.ones(len(texts), dtype=torch.long)


def _per_sample_losses(task: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each example's own loss `[B]` (the terms of loss_for_task's mean)."""
    if task == "causal_lm":
        return per_sample_token_losses(logits, labels[:, : logits.shape[1]])
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


@pytest.mark.parametrize("kind", KINDS)
def test_padding_is_out_of_an_examples_loss_and_gradient(folders: dict[str, Path], kind: str) -> None:
    """An example padded in a batch with a longer one has the loss and the per-sample gradient
    (dptrain's hooks) of the same example alone without padding (float64), also when the pad
    token is the end token (GPT-2, Llama): padding is read from the attention mask."""
    from dptrain.grad_sample.check import microbatch_grad_samples, wrapped_grad_samples

    task = "causal_lm" if kind in CAUSAL_KINDS else "sequence_classification"
    model = build_hf_model(str(folders[kind]), task=task, pad_token=PAD_TOKENS[kind], dtype="float64")
    texts = ["i liked it", "the pub is in the riverside area and serves cheap food"]
    x, y = _encoded(model.tokenizer, task, texts, 24)
    ids, mask = unpack_inputs(x)
    length = int(mask[0].sum())
    assert length < int(mask[1].sum())                 # example 0 is padded within the batch
    alone_x, alone_y = _encoded(model.tokenizer, task, texts[:1], length)
    assert int(unpack_inputs(alone_x)[1].sum()) == length               # alone: no padding
    assert torch.equal(alone_x[0, :length], ids[0, :length])
    if task == "causal_lm":  # pad == end token: only the mask tells the real end from padding
        assert int(ids[0, length]) == int(ids[0, length - 1]) == model.tokenizer.eos_token_id
        assert int(y[0, length - 1]) == model.tokenizer.eos_token_id and int(y[0, length]) == -100
    loss_fn = loss_for_task(task)
    with torch.no_grad():
        torch.testing.assert_close(_per_sample_losses(task, model(x), y)[0],
                                   _per_sample_losses(task, model(alone_x), alone_y)[0])
    in_batch = wrapped_grad_samples(model, x, y, loss_fn)
    alone = microbatch_grad_samples(model, alone_x, alone_y, loss_fn)
    assert in_batch.keys() == alone.keys()
    for name, grads in alone.items():
        torch.testing.assert_close(in_batch[name][0], grads[0], msg=name)
