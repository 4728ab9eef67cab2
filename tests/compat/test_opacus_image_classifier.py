"""Opacus's image-classifier tutorial (tutorials/building_image_classifier.ipynb, vendored in
opacus_tutorials/ as its code cells with only their `opacus` imports changed to
`dptrain.opacus`) trains on dptrain.opacus, with the sigma Opacus calibrates for its settings
and the epsilon Opacus's accountant gives for the steps it took.

Its settings are kept (torchvision's resnet18 fixed by ModuleValidator.fix, RMSprop, a logical
batch of 512 in physical batches of 128 by BatchMemoryManager, make_private_with_epsilon for
epsilon 50 at delta 1e-5 over EPOCHS = 20). Changed for a CPU run: CIFAR10 is served by 512
training and 64 test images of random pixels with CIFAR10's item types (so the loader has one
batch, q = 1, and each step's 512 rows make four physical batches), and the 20-epoch loop (its
cell with tqdm.notebook) is replaced by one call of the tutorial's own train() for epoch 1, as
the LSTM name-classifier test does; EPOCHS stays 20 for the calibration.

Opacus is not trained here: with torch 2.14 its training of this tutorial stops
(`RuntimeError: Output 0 of BackwardHookFunction is a view and is being modified inplace`,
raised in torch.relu_ through Opacus's backward hooks, by resnet's in-place ReLU).
Its sigma comes from its own calibration (opacus.accountants.utils.get_noise_multiplier at the
same q, epochs, epsilon and delta), its epsilon from its PRVAccountant over the run's history.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_opacus_examples import _SyntheticCIFAR10, _tutorial_cells

TUTORIAL = "building_image_classifier"
# its code cells: 0-1 settings, 2-3 CIFAR10 and its loaders, 4-6 resnet18 and
# ModuleValidator.fix, 7-9 device, RMSprop, accuracy, 10 make_private_with_epsilon, 11 train()
# with BatchMemoryManager, 12 test(), 13 the loop of EPOCHS epochs under tqdm.notebook, 14 test
MAKE_PRIVATE, EPOCH_LOOP = 10, 13


class _CIFAR10(_SyntheticCIFAR10):
    """CIFAR10's item types over random pixels: 512 training images, one logical batch of the
    tutorial's 512 (dptrain.opacus refuses a batch size above N; Opacus would take q = 1)."""

    sizes = (512, 64)


def _run_image_classifier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The tutorial's cells on dptrain.opacus, its 20-epoch loop replaced by one epoch of its
    train(). Returns its namespace with `sample_rate` (Opacus's q: 1 / batches of the original
    loader), `losses` (each CrossEntropyLoss value it computed, training then test, in order)
    and `before` / `after` (the model's parameters around training)."""
    import torchvision.datasets

    losses: list[float] = []
    forward = torch.nn.CrossEntropyLoss.forward

    def recording(self: torch.nn.CrossEntropyLoss, *args: Any) -> torch.Tensor:
        loss = forward(self, *args)
        losses.append(float(loss))
        return loss

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", _CIFAR10)
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward", recording)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": f"{TUTORIAL}_on_dptrain_opacus"}
    cells = _tutorial_cells(TUTORIAL, "dptrain.opacus")
    with warnings.catch_warnings():
        for index, cell in enumerate(cells[:EPOCH_LOOP]):
            if index == MAKE_PRIVATE:  # before it replaces train_loader
                namespace["sample_rate"] = 1 / len(namespace["train_loader"])
            exec(compile(cell, f"{TUTORIAL} cell {index}", "exec"), namespace)  # noqa: S102
        model = namespace["model"]
        namespace["before"] = [p.detach().clone() for p in model.parameters()]
        namespace["train"](model, namespace["train_loader"], namespace["optimizer"], 1,
                           namespace["device"])
        namespace["after"] = [p.detach().clone() for p in model.parameters()]
        for cell in cells[EPOCH_LOOP + 1:]:
            exec(compile(cell, f"{TUTORIAL} test cell", "exec"), namespace)  # noqa: S102
    namespace["losses"] = losses
    return namespace


@pytest.fixture(scope="module")
def image_classifier_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        return _run_image_classifier(patch, tmp_path_factory.mktemp(TUTORIAL))


@pytest.mark.slow  # 45 s of CPU (70 s on the shared 2-core machine); 7 GB at its peak
def test_image_classifier_tutorial_trains_resnet18(image_classifier_run):
    run = image_classifier_run
    # one step at q = 1: 512 rows in four physical batches of 128, then one test batch of 64
    assert run["privacy_engine"].accountant.history == [
        (run["optimizer"].noise_multiplier, 1.0, 1)]
    assert len(run["losses"]) == 5 and all(math.isfinite(loss) for loss in run["losses"])
    assert all(torch.isfinite(p).all() for p in run["after"])
    assert any(not torch.equal(b, a) for b, a in zip(run["before"], run["after"]))
    assert 0.0 <= run["top1_acc"] <= 1.0


@pytest.mark.slow
def test_image_classifier_tutorial_uses_opacus_sigma(image_classifier_run):
    from opacus.accountants.utils import get_noise_multiplier

    run = image_classifier_run
    theirs = get_noise_multiplier(target_epsilon=run["EPSILON"], target_delta=run["DELTA"],
                                  sample_rate=run["sample_rate"], epochs=run["EPOCHS"],
                                  accountant="prv", epsilon_tolerance=0.01)
    assert run["optimizer"].noise_multiplier == pytest.approx(theirs, rel=1e-3)


@pytest.mark.slow
def test_image_classifier_tutorial_reports_opacus_epsilon(image_classifier_run):
    from opacus.accountants import PRVAccountant

    run = image_classifier_run
    accountant = PRVAccountant()
    accountant.history = list(run["privacy_engine"].accountant.history)
    theirs = accountant.get_epsilon(delta=run["DELTA"])
    ours = run["privacy_engine"].get_epsilon(run["DELTA"])
    assert theirs > 0 and ours == pytest.approx(theirs, rel=1e-3)
