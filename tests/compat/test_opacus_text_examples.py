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

import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from dptrain.opacus.accountants import PRVAccountant
from tests.compat.test_opacus_examples import _epsilon, _load
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
    texts, labels = [], []
    for i in range(count):
        label = i % 2
        pool = sentences(label)
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


def _run_imdb(package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
              tokenizer: Any) -> tuple[float, Any]:
    """examples/imdb.py's main() for one epoch at its defaults (batch 64, sigma 0.56, C 1.0) on
    _imdb() and `tokenizer`; (epsilon at delta 1e-5, the engine's accountant)."""
    def load_dataset(path: str, **kwargs: Any) -> Any:
        assert path == "imdb"
        return _imdb()

    def from_pretrained(cls: type, name: str, *args: Any, **kwargs: Any) -> Any:
        assert name == "bert-base-cased"
        return tokenizer

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(transformers.BertTokenizerFast, "from_pretrained",
                        classmethod(from_pretrained))
    module = _load("imdb", package)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["imdb.py", "--device", "cpu", "-n", "1", "-j", "0",
                                      "--data-root", str(tmp_path / "imdb")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    (engine,) = module.engines
    return _epsilon(module, 1e-5), engine.accountant


def _composed_gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at `delta` of a mu-GDP mechanism (Dong, Roth, Su 2019, Corollary 2.13):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved for eps."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 100.0, xtol=1e-12)


def test_imdb_example_is_charged_as_a_shuffle_where_opacus_charges_poisson(monkeypatch, tmp_path):
    """imdb.py passes poisson_sampling=False: dptrain.opacus trains on fixed-size batches of a
    shuffle and charges one epoch as one Gaussian mechanism of sensitivity 2 C (mu = 2 / sigma,
    no amplification); Opacus keeps the shuffled loader but charges it as Poisson sampling at
    q = 1 / (batches per epoch), a smaller epsilon than the batches it really trains on allow."""
    tokenizer = _cased_bert_tokenizer(tmp_path / "bert-base-cased")
    ours, accountant = _run_imdb("dptrain.opacus", monkeypatch, tmp_path, tokenizer)
    theirs, _ = _run_imdb("opacus", monkeypatch, tmp_path, tokenizer)
    sigma, batches = 0.56, 256 // 64
    assert accountant.history == [(sigma, 64 / 256, batches)]
    assert ours == pytest.approx(_composed_gaussian_epsilon(2 / sigma, 1e-5), rel=1e-6)
    poisson = PRVAccountant()  # the example's accountant over Opacus's Poisson charge
    poisson.history = [(sigma, 1 / batches, batches)]
    assert theirs == pytest.approx(poisson.get_epsilon(1e-5), rel=1e-3)
    assert theirs < ours
