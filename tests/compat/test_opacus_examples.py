"""Opacus's examples (examples/*.py of the Opacus repository, vendored in opacus_examples/ with
only their `opacus` imports changed to `dptrain.opacus`) run as written on synthetic data of the
datasets' shapes, for a few steps, and report the epsilon Opacus reports for the same run.

The Opacus original is the same file with the import lines put back, run the same way.
Here: mnist, char-lstm-classification, cifar10 and the LSTM name-classifier tutorial (vendored in
opacus_tutorials/ as its code cells). Elsewhere: imdb.py and the text-classifier tutorial in
test_opacus_text_examples.py (which serves their downloads), dcgan.py in
test_opacus_example_dcgan.py, vision_benchmark.py in
test_opacus_example_vision_benchmark.py, the image-classifier tutorial in
test_opacus_image_classifier.py, the advanced-features, grad-sampler and module-validator guides in
test_opacus_guides.py, the DDP tutorial and fsdp_example.py in
test_opacus_distributed_examples.py. docs/migrating-from-opacus.md says what is not run and why.
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

EXAMPLES = Path(__file__).parent / "opacus_examples"


def _load(name: str, package: str) -> types.ModuleType:
    """The example `name` importing from `package` ("dptrain.opacus" as vendored, or "opacus"),
    with its PrivacyEngine recording each engine it makes in `module.engines`."""
    path = EXAMPLES / f"{name}.py"
    source = path.read_text()
    if package == "opacus":
        source = source.replace("from dptrain.opacus", "from opacus")
    module = types.ModuleType(f"{name}_on_{package.replace('.', '_')}")
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 (vendored file)
    engines: list[Any] = []

    class RecordingEngine(module.PrivacyEngine):  # type: ignore[name-defined, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    module.PrivacyEngine = RecordingEngine
    module.engines = engines
    return module


def _epsilon(module: types.ModuleType, delta: float) -> float:
    (engine,) = module.engines
    return float(engine.accountant.get_epsilon(delta=delta))


class _SyntheticImages(torch.utils.data.Dataset):
    """A torchvision dataset's interface and item types (an 8-bit PIL image, an int label of 10
    classes) over random pixels: `sizes` (training, test) images, 256 and 64 unless a subclass
    says otherwise, of `shape` (H, W) or (H, W, 3)."""

    shape: tuple[int, ...]
    sizes: tuple[int, int] = (256, 64)

    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Any = None) -> None:
        generator = np.random.default_rng(0 if train else 1)
        size = self.sizes[0] if train else self.sizes[1]
        self.images = generator.integers(0, 256, (size, *self.shape), dtype=np.uint8)
        self.labels = generator.integers(0, 10, size)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image = Image.fromarray(self.images[i])
        return (self.transform(image) if self.transform else image), int(self.labels[i])


class _SyntheticMNIST(_SyntheticImages):
    shape = (28, 28)


class _SyntheticCIFAR10(_SyntheticImages):
    shape = (32, 32, 3)


def _run_mnist(package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> float:
    module = _load("mnist", package)
    monkeypatch.setattr(module.datasets, "MNIST", _SyntheticMNIST)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mnist.py", "--device", "cpu", "-n", "1", "-b", "64",
                                      "--sigma", "1.0", "-c", "1.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    return _epsilon(module, 1e-5)


def test_mnist_example_reports_opacus_epsilon(monkeypatch, tmp_path):
    ours = _run_mnist("dptrain.opacus", monkeypatch, tmp_path)
    theirs = _run_mnist("opacus", monkeypatch, tmp_path)
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)


def _names_folder(root: Path) -> Path:
    """A names/ folder as the char-LSTM example reads it: one <language>.txt per label, one name
    a line (synthetic names of 3-10 ASCII letters)."""
    generator = np.random.default_rng(0)
    root.mkdir()
    for language in ("Czech", "Dutch", "Greek", "Irish"):
        names = ["".join(chr(ord("a") + int(c)) for c in generator.integers(0, 26, n))
                 for n in generator.integers(3, 11, 40)]
        (root / f"{language}.txt").write_text("\n".join(n.title() for n in names) + "\n")
    return root


def _run_char_lstm(package: str, mode: str, monkeypatch: pytest.MonkeyPatch,
                   tmp_path: Path, names: Path) -> float:
    module = _load("char_lstm_classification", package)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "char-lstm-classification.py", "--data-root", str(names), "--device", "cpu",
        "--batch-size", "32", "--mode", mode, "--embedding-size", "8", "--hidden-size", "16",
        "--epochs", "1", "--sigma", "1.0", "--max-per-sample-grad-norm", "1.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    return _epsilon(module, 8e-5)


@pytest.mark.parametrize("mode", ["lstm", pytest.param("gru", marks=pytest.mark.slow),
                                  pytest.param("rnn", marks=pytest.mark.slow)])
def test_char_lstm_example_reports_opacus_epsilon(mode, monkeypatch, tmp_path):
    names = _names_folder(tmp_path / "names")
    ours = _run_char_lstm("dptrain.opacus", mode, monkeypatch, tmp_path, names)
    theirs = _run_char_lstm("opacus", mode, monkeypatch, tmp_path, names)
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)


def _run_cifar10(package: str, flags: list[str], monkeypatch: pytest.MonkeyPatch,
                 tmp_path: Path) -> float:
    module = _load("cifar10", package)
    monkeypatch.setattr(module, "CIFAR10", _SyntheticCIFAR10)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "cifar10.py", "--device", "cpu", "--epochs", "1", "--batch-size", "64",
        "--batch-size-test", "64", "-j", "0", "--sigma", "1.5", "-c", "10.0",
        "--checkpoint-file", str(tmp_path / "checkpoint"), *flags])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    return _epsilon(module, 1e-5)


@pytest.mark.slow  # about 10 s each on an idle core, twice that on a shared one
@pytest.mark.parametrize("flags", [[], ["--clip_per_layer"]], ids=["flat", "per_layer"])
def test_cifar10_example_reports_opacus_epsilon(flags, monkeypatch, tmp_path):
    ours = _run_cifar10("dptrain.opacus", flags, monkeypatch, tmp_path)
    theirs = _run_cifar10("opacus", flags, monkeypatch, tmp_path)
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)


TUTORIALS = Path(__file__).parent / "opacus_tutorials"


def _tutorial_cells(name: str, package: str) -> list[str]:
    """The code cells of the vendored tutorial `name` (opacus_tutorials/), importing from
    `package`."""
    source = (TUTORIALS / f"{name}.py").read_text()
    if package == "opacus":
        source = source.replace("from dptrain.opacus", "from opacus")
    return source.split("# %%\n")[1:]


def _names_zip(url: str, filename: str) -> None:
    """Stands in for urllib.request.urlretrieve of the names data.zip: a zip of data/names/ with
    500 synthetic names in each of 4 languages (the tutorial's batch is 800)."""
    import zipfile

    generator = np.random.default_rng(0)
    with zipfile.ZipFile(filename, "w") as archive:
        for language in ("Czech", "Dutch", "Greek", "Irish"):
            names = ["".join(chr(ord("a") + int(c)) for c in generator.integers(0, 26, n)).title()
                     for n in generator.integers(3, 11, 500)]
            archive.writestr(f"data/names/{language}.txt", "\n".join(names) + "\n")


def _run_name_classifier(package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> float:
    """The LSTM name-classifier tutorial's cells up to make_private_with_epsilon (its download
    served by _names_zip), then one epoch of its own train() (its loop runs 50)."""
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlretrieve", _names_zip)
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": f"building_lstm_name_classifier_on_{package}"}
    cells = _tutorial_cells("building_lstm_name_classifier", package)
    with warnings.catch_warnings():
        for cell in cells[:13]:  # then: the 50-epoch loop and the non-private comparison
            exec(compile(cell, "building_lstm_name_classifier", "exec"), namespace)  # noqa: S102
        namespace["train"](namespace["model"], namespace["criterion"], namespace["optimizer"],
                           namespace["train_loader"], 0, namespace["privacy_engine"],
                           device=namespace["device"])
    return float(namespace["privacy_engine"].get_epsilon(namespace["delta"]))


@pytest.mark.slow  # about 40 s on an idle core
def test_lstm_name_classifier_tutorial_reports_opacus_epsilon(monkeypatch, tmp_path):
    ours = _run_name_classifier("dptrain.opacus", monkeypatch, tmp_path / "ours")
    theirs = _run_name_classifier("opacus", monkeypatch, tmp_path / "theirs")
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)
