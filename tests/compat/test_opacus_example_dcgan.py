"""Opacus's examples/dcgan.py (vendored in opacus_examples/ with only its `opacus` import changed
to `dptrain.opacus`) run as the script it is (runpy, its argparse reading a patched sys.argv) on
synthetic MNIST-shaped data for one short epoch, and report the epsilon Opacus reports for the
same run.

The script makes only the discriminator private; each of its steps backpropagates through two
forward passes of it (a real batch and a generated one), which both packages count as one batch
of per-sample rows (row i: real example i's gradient plus generated example i's). With torch 2.14,
Opacus's backward hooks refuse the discriminator's in-place LeakyReLU (RuntimeError: "Output 0 of
BackwardHookFunction is a view and is being modified inplace"), so the Opacus run here builds
that LeakyReLU out of place (the same function); dptrain.opacus runs the script as written.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from test_opacus_examples import EXAMPLES
from torch import nn


class _SyntheticMNIST(torchvision.datasets.MNIST):
    """torchvision's MNIST (its __getitem__: a PIL 8-bit image and an int label) over 400 random
    28x28 images with random labels 0-9, without download."""

    def __init__(self, root: str, train: bool = True, transform: Any = None,
                 target_transform: Any = None, download: bool = False) -> None:
        torchvision.datasets.VisionDataset.__init__(self, root, transform=transform,
                                                    target_transform=target_transform)
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (400, 28, 28), dtype=torch.uint8, generator=generator)
        self.targets = torch.randint(0, 10, (400,), generator=generator)


class _OutOfPlaceLeakyReLU(nn.LeakyReLU):
    """nn.LeakyReLU computed out of place whatever `inplace` says (Opacus's hooks on torch 2.14
    refuse the in-place one)."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__(negative_slope, inplace=False)


def _run_dcgan(package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """dcgan.py importing from `package`, as a script: the 42 synthetic images of its target
    digit 8 at 64x64, batch 16, one epoch (3 steps), small networks (nz 16, ngf = ndf = 8).
    Returns the script's globals."""
    source = (EXAMPLES / "dcgan.py").read_text()
    if package == "opacus":
        source = source.replace("from dptrain.opacus", "from opacus")
        monkeypatch.setattr(nn, "LeakyReLU", _OutOfPlaceLeakyReLU)
    tmp_path.mkdir()
    script = tmp_path / "dcgan.py"
    script.write_text(source)
    monkeypatch.setattr(torchvision.datasets, "MNIST", _SyntheticMNIST)
    monkeypatch.setattr(sys, "argv", [
        "dcgan.py", "--data-root", str(tmp_path), "--device", "cpu", "--workers", "0",
        "--batch-size", "16", "--nz", "16", "--ngf", "8", "--ndf", "8", "--epochs", "1",
        "--outf", str(tmp_path), "--manualSeed", "0", "--sigma", "1.0", "-c", "1.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return runpy.run_path(str(script), run_name="__main__")


@pytest.mark.slow  # about 10 s each on a shared core
def test_dcgan_example_reports_opacus_epsilon(monkeypatch, tmp_path):
    ours = _run_dcgan("dptrain.opacus", monkeypatch, tmp_path / "ours")
    theirs = _run_dcgan("opacus", monkeypatch, tmp_path / "theirs")
    assert len(ours["dataset"]) == len(theirs["dataset"]) == 42
    # 42 examples in batches of 16: both sample at Opacus's q = 1 / len(loader) = 1/3, 3 steps
    assert ours["privacy_engine"].accountant.history == [(1.0, 1 / 3, 3)]
    assert theirs["privacy_engine"].accountant.history == [(1.0, 1 / 3, 3)]
    epsilon = [float(run["privacy_engine"].accountant.get_epsilon(delta=1e-5))
               for run in (ours, theirs)]
    assert epsilon[1] > 0 and epsilon[0] == pytest.approx(epsilon[1], rel=1e-3)
    # the script's end: the networks checkpointed, the generated samples saved
    assert (tmp_path / "ours" / "netD_epoch_0.pth").exists()
    assert (tmp_path / "ours" / "fake_samples_epoch_000.png").exists()
