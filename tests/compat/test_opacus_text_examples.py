"""Opacus's text examples on dptrain.opacus and on Opacus, without downloads: examples/imdb.py
(vendored in opacus_examples/) and the text-classifier tutorial (its code cells, vendored in
opacus_tutorials/building_text_classifier.py).

Their downloads are served locally: the IMDb dataset by a small in-memory `datasets.DatasetDict`
of IMDb's splits and features whose reviews are real English sentences (tests/sentiment_sentences),
the `bert-base-cased` tokenizer by a real `BertTokenizerFast` over a small cased WordPiece
vocabulary of those sentences' words, the SNLI zip by a small zip of SNLI's tab-separated files,
and the pretrained `bert-base-cased` model by a tiny random-init BERT saved where
`from_pretrained("bert-base-cased")` finds it (a local folder of that name).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from dptrain.opacus.accountants import PRVAccountant
from tests.compat.test_opacus_examples import _load, _tutorial_cells
from tests.sentiment_sentences import sentences

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
hf_tiny = pytest.importorskip("tests.hf_tiny")


def _words(texts: list[str]) -> tuple[str, ...]:
    """The distinct words and punctuation marks of `texts`, as BERT's pre-tokenizer splits them."""
    return tuple(dict.fromkeys(w for text in texts for w in re.findall(r"\w+|[^\w\s]", text)))


def _reviews(count: int, offset: int) -> tuple[list[str], list[int]]:
    """`count` reviews, alternately negative (0) and positive (1), each 1-6 sentences of its
    class from sentiment_sentences; review i starts at sentence 7 (offset + i) of its class."""
    pools = {label: sentences(label) for label in (0, 1)}
    texts, labels = [], []
    for i in range(count):
        label = i % 2
        pool = pools[label]
        start, length = 7 * (offset + i), 1 + (offset + i) % 6
        texts.append(" ".join(pool[(start + k) % len(pool)] for k in range(length)))
        labels.append(label)
    return texts, labels


def _imdb() -> Any:
    """An IMDb-shaped DatasetDict: IMDb's splits (train, test, unsupervised) and features (text,
    label as ClassLabel neg/pos; -1 in the unlabelled split), 256 / 64 / 32 reviews."""
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    splits = {}
    for split, count, offset in (("train", 256, 0), ("test", 64, 256), ("unsupervised", 32, 320)):
        texts, labels = _reviews(count, offset)
        if split == "unsupervised":
            labels = [-1] * count
        splits[split] = datasets.Dataset.from_dict({"text": texts, "label": labels},
                                                   features=features)
    return datasets.DatasetDict(splits)


def _cased_bert_tokenizer(folder: Path) -> Any:
    """A cased BertTokenizerFast (bert-base-cased's kind) whose WordPiece vocabulary holds every
    word of the sentiment sentences."""
    return hf_tiny.bert_tokenizer(folder, words=_words(sentences(0) + sentences(1)), cased=True)


def _run_imdb(package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, imdb: Any,
              tokenizer: Any) -> tuple[float, Any]:
    """examples/imdb.py's main() for one epoch at its defaults (batch 64, sigma 0.56, C 1.0) on
    the DatasetDict `imdb` and `tokenizer`; (the epsilon it reports after its epoch, at its delta
    1e-5; the engine's accountant)."""
    def load_dataset(path: str, **kwargs: Any) -> Any:
        assert path == "imdb"
        return imdb

    def from_pretrained(cls: type, name: str, *args: Any, **kwargs: Any) -> Any:
        assert name == "bert-base-cased"
        return tokenizer

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(transformers.BertTokenizerFast, "from_pretrained",
                        classmethod(from_pretrained))
    module = _load("imdb", package)
    reported: list[float] = []

    class ReportingEngine(module.PrivacyEngine):  # type: ignore[name-defined, misc]
        """Keeps each epsilon the example asks its accountant for (one Opacus PRV epsilon takes
        about a second: asking again after the run would double the test's time)."""

        def make_private(self, **kwargs: Any) -> tuple:
            made = super().make_private(**kwargs)
            accountant, get_epsilon = self.accountant, self.accountant.get_epsilon

            def recorded(*args: Any, **kwargs: Any) -> float:
                reported.append(float(get_epsilon(*args, **kwargs)))
                return reported[-1]

            accountant.get_epsilon = recorded
            return made

    monkeypatch.setattr(module, "PrivacyEngine", ReportingEngine)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["imdb.py", "--device", "cpu", "-n", "1", "-j", "0",
                                      "--data-root", str(tmp_path / "imdb")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    (engine,) = module.engines
    assert len(reported) == 1  # the example's print after its one epoch
    return reported[0], engine.accountant


def _composed_gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at `delta` of a mu-GDP mechanism (Dong, Roth, Su 2019, Corollary 2.13):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved for eps."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 100.0, xtol=1e-12)


def test_imdb_example_is_charged_as_a_shuffle_where_opacus_charges_poisson(monkeypatch, tmp_path):
    """imdb.py passes poisson_sampling=False: dptrain.opacus keeps its shuffled DataLoader
    (shuffle=True: a RandomSampler without replacement) and charges one pass as one Gaussian
    mechanism of sensitivity 2 C (mu = 2 / sigma, no amplification); Opacus keeps the shuffled loader but charges it as Poisson sampling at
    q = 1 / (batches per epoch), a smaller epsilon than the batches it really trains on allow."""
    tokenizer = _cased_bert_tokenizer(tmp_path / "bert-base-cased")
    imdb = _imdb()
    ours, accountant = _run_imdb("dptrain.opacus", monkeypatch, tmp_path, imdb, tokenizer)
    theirs, _ = _run_imdb("opacus", monkeypatch, tmp_path, imdb, tokenizer)
    sigma, batches = 0.56, 256 // 64
    assert accountant.history == [(sigma, 64 / 256, batches)]
    assert ours == pytest.approx(_composed_gaussian_epsilon(2 / sigma, 1e-5), rel=1e-6)
    poisson = PRVAccountant()  # the example's accountant over Opacus's Poisson charge
    poisson.history = [(sigma, 1 / batches, batches)]
    assert theirs == pytest.approx(poisson.get_epsilon(1e-5), rel=1e-3)
    assert theirs < ours


# ----------------------------------------------------------------------------- text classifier
SNLI_COLUMNS = ("gold_label", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "captionID",
                "pairID", "label1", "label2", "label3", "label4", "label5")
SNLI_SUBJECTS = ("A man", "A woman", "Two children", "A young girl", "An old man", "A dog",
                 "A group of friends", "A tired worker")
# (premise's activity, then the hypothesis's for entailment, contradiction, neutral)
SNLI_SCENES = (
    ("is playing a guitar on a stage", "is playing an instrument", "is sleeping at home",
     "is playing a song for a crowd"),
    ("is walking through a busy market", "is outside", "is sitting in a car",
     "is shopping for fresh fruit"),
    ("is riding a bicycle down a hill", "is riding a bike", "is swimming in a lake",
     "is racing to win a prize"),
    ("is reading a book in a park", "is reading", "is dancing at a party",
     "is reading a novel for school"),
    ("is cooking dinner in a small kitchen", "is making food", "is running a marathon",
     "is cooking for a family"),
    ("is climbing a tall rock wall", "is climbing", "is eating lunch indoors",
     "is training for a competition"),
)
SNLI_LABELS = ("entailment", "contradiction", "neutral")


def _snli_rows(count: int, offset: int) -> list[dict[str, str]]:
    """`count` SNLI rows (every column of snli_1.0_*.txt; the parses are left plain): premise
    and hypothesis about one subject and scene, the three labels in turn, and every 16th row
    without a gold label ("-", which the tutorial filters out)."""
    rows = []
    for i in range(offset, offset + count):
        subject = SNLI_SUBJECTS[i % len(SNLI_SUBJECTS)]
        scene = SNLI_SCENES[(i // len(SNLI_SUBJECTS)) % len(SNLI_SCENES)]
        label = SNLI_LABELS[i % 3]
        premise = f"{subject} {scene[0]}."
        hypothesis = f"{subject} {scene[1 + i % 3]}."
        gold = "-" if i % 16 == 15 else label
        rows.append({"gold_label": gold, "sentence1_binary_parse": premise,
                     "sentence2_binary_parse": hypothesis, "sentence1_parse": premise,
                     "sentence2_parse": hypothesis, "sentence1": premise,
                     "sentence2": hypothesis, "captionID": f"{i}.jpg#0", "pairID": f"{i}.jpg#0r1",
                     **{f"label{k}": label for k in range(1, 6)}})
    return rows


def _snli_zip(url: str, filename: str) -> None:
    """Stands in for urllib.request.urlretrieve of snli_1.0.zip: snli_1.0/snli_1.0_{train,dev,
    test}.txt, tab-separated as SNLI's, 204 / 64 / 64 rows (192 train rows with a gold label)."""
    import csv
    import io
    import zipfile

    with zipfile.ZipFile(filename, "w") as archive:
        for split, count, offset in (("train", 204, 0), ("dev", 64, 1000), ("test", 64, 2000)):
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=SNLI_COLUMNS, delimiter="\t",
                                    lineterminator="\n")
            writer.writeheader()
            writer.writerows(_snli_rows(count, offset))
            archive.writestr(f"snli_1.0/snli_1.0_{split}.txt", text.getvalue())


def _save_pretrained_bert(folder: Path) -> None:
    """A tiny random-init BERT encoder (2 layers of width 16, 128 positions, no task head: as the
    bert-base-cased checkpoint, whose classifier from_pretrained initialises) and a cased
    WordPiece tokenizer of the SNLI rows' words, saved in `folder`."""
    import torch

    texts = [r[c] for r in _snli_rows(2048, 0) for c in ("sentence1", "sentence2")]
    tokenizer = hf_tiny.bert_tokenizer(folder, words=_words(texts), cased=True)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _glue_modules() -> dict[str, types.ModuleType]:
    """transformers.data.processors.{utils,glue} as transformers 4 had them (removed in
    transformers 5, which the tutorial's cell imports): InputExample and the classification
    path of glue_convert_examples_to_features, which tokenizes each (text_a, text_b) pair padded
    and truncated to max_length and maps labels to their index in label_list."""
    @dataclasses.dataclass
    class InputExample:
        guid: str
        text_a: str
        text_b: str | None = None
        label: str | None = None

    @dataclasses.dataclass(frozen=True)
    class InputFeatures:
        input_ids: list[int]
        attention_mask: list[int] | None = None
        token_type_ids: list[int] | None = None
        label: int | float | None = None

    def glue_convert_examples_to_features(examples: list[InputExample], tokenizer: Any,
                                          max_length: int | None = None, task: Any = None,
                                          label_list: list[str] | None = None,
                                          output_mode: str | None = None) -> list[InputFeatures]:
        assert task is None and output_mode == "classification" and label_list is not None
        index = {label: i for i, label in enumerate(label_list)}
        encoding = tokenizer([(e.text_a, e.text_b) for e in examples],
                             max_length=max_length or tokenizer.model_max_length,
                             padding="max_length", truncation=True)
        return [InputFeatures(**{k: encoding[k][i] for k in encoding}, label=index[e.label])
                for i, e in enumerate(examples)]

    processors = types.ModuleType("transformers.data.processors")
    utils = types.ModuleType("transformers.data.processors.utils")
    glue = types.ModuleType("transformers.data.processors.glue")
    utils.InputExample, utils.InputFeatures = InputExample, InputFeatures
    glue.InputExample, glue.InputFeatures = InputExample, InputFeatures
    glue.glue_convert_examples_to_features = glue_convert_examples_to_features
    processors.utils, processors.glue = utils, glue
    return {m.__name__: m for m in (processors, utils, glue)}


# The tutorial's three trainings: the code cell (index among its code cells) after whose loop
# each one's engine is read, and the name of its DP optimizer there.
TEXT_CLASSIFIER_PARTS = {"dp_sgd": (15, "optimizer"), "ghost_clipping": (17, "optimizer_gc"),
                         "lora_ghost_clipping": (23, "optimizer_lora")}


def _run_text_classifier(package: str, tmp_path: Path) -> dict[str, tuple[float, float]]:
    """Every code cell of the text-classifier tutorial as written (its 3 epochs of each of its 3
    trainings), importing from `package`; {part: (noise multiplier, epsilon at its DELTA)}.

    Stand-ins for what a notebook kernel with downloads has: the SNLI zip (_snli_zip), a local
    bert-base-cased folder (_save_pretrained_bert), img/BERT.png (the cell that shows it),
    transformers 4's GLUE helpers (_glue_modules) where transformers 5 lacks them,
    tqdm.notebook's bar as the plain tqdm (no ipywidgets here), and without CUDA,
    torch.device("cpu") for the cells' torch.device("cuda:0").
    """
    import urllib.request

    import torch
    import tqdm.notebook
    import tqdm.std
    from PIL import Image

    cells = _tutorial_cells("building_text_classifier", package)
    results: dict[str, tuple[float, float]] = {}
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(urllib.request, "urlretrieve", _snli_zip)
        if importlib.util.find_spec("transformers.data.processors") is None:
            for name, module in _glue_modules().items():
                patch.setitem(sys.modules, name, module)
        patch.setattr(tqdm.notebook, "tqdm", tqdm.std.tqdm)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)  # set by two cells
        tmp_path.mkdir()
        patch.chdir(tmp_path)
        _save_pretrained_bert(tmp_path / "bert-base-cased")
        (tmp_path / "img").mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / "img" / "BERT.png")
        namespace: dict[str, Any] = {"__name__": f"building_text_classifier_on_{package}"}
        for index, cell in enumerate(cells):
            if not torch.cuda.is_available():
                cell = cell.replace('torch.device("cuda:0")', 'torch.device("cpu")')
            exec(compile(cell, f"building_text_classifier cell {index}", "exec"),  # noqa: S102
                 namespace)
            for part, (after, optimizer) in TEXT_CLASSIFIER_PARTS.items():
                if index == after:
                    results[part] = (float(namespace[optimizer].noise_multiplier), float(
                        namespace["privacy_engine"].get_epsilon(namespace["DELTA"])))
    return results


@pytest.fixture(scope="module")
def text_classifier_runs(tmp_path_factory: pytest.TempPathFactory
                         ) -> dict[str, dict[str, tuple[float, float]]]:
    """The tutorial run on dptrain.opacus ("ours") and on Opacus ("theirs")."""
    pytest.importorskip("IPython", reason="a cell shows an image with IPython.display")
    root = tmp_path_factory.mktemp("text_classifier")
    return {"ours": _run_text_classifier("dptrain.opacus", root / "ours"),
            "theirs": _run_text_classifier("opacus", root / "theirs")}


@pytest.mark.slow  # both runs: about 80 s on the shared 2-core machine (Opacus's calibrations)
@pytest.mark.parametrize("part", list(TEXT_CLASSIFIER_PARTS))
def test_text_classifier_tutorial_reports_opacus_sigma_and_epsilon(part, text_classifier_runs):
    (our_sigma, ours) = text_classifier_runs["ours"][part]
    (their_sigma, theirs) = text_classifier_runs["theirs"][part]
    assert our_sigma == pytest.approx(their_sigma, rel=1e-3)
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)
