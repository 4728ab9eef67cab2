"""Opacus's examples/vision_benchmark.py (vendored in opacus_examples/ with its `opacus` imports
changed to `dptrain.opacus`) run by its main() on one CPU process, with its own command-line
arguments chosen small: ImageNet-shaped 3x224x224 images of its own random data, batch 4, 2
steps, `--architecture mobilenet_v2` (the smallest torchvision model its GroupNorm-of-8-groups
`norm_layer` fits that Opacus trains with torch 2.14; resnet18, its default, stops Opacus's
backward hooks even with its ReLUs out of place).

Beyond the imports the vendored file runs on the device of `--device` where it hard-coded CUDA
(`.cuda()` -> `.to(args.device)`, `torch.cuda.synchronize()` only on a CUDA device), each line
marked `# was ...`. With torch 2.14, Opacus's backward hooks refuse mobilenet_v2's in-place ReLU6
(RuntimeError: "Output 0 of BackwardHookFunction is a view and is being modified inplace"), so
the Opacus run builds that ReLU6 out of place (the same function); dptrain.opacus runs the
model as torchvision builds it.
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
from torch import nn

from dptrain.errors import PrivacyError
from dptrain.opacus.accountants import PRVAccountant
from tests.compat.test_opacus_examples import _load
from tests.compat.test_opacus_text_examples import _composed_gaussian_epsilon

SIGMA, BATCH, STEPS = 1.5, 4, 2


class _OutOfPlaceReLU6(nn.ReLU6):
    """nn.ReLU6 computed out of place whatever `inplace` says (Opacus's hooks on torch 2.14
    refuse the in-place one)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(inplace=False)


def _run_vision_benchmark(package: str, flags: list[str], monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> types.ModuleType:
    """vision_benchmark.py importing from `package`, its main() on mobilenet_v2 at 3x224x224,
    batch BATCH, STEPS steps, sigma SIGMA, C 1.0, plus `flags`. Returns the module (its
    `engines`: the PrivacyEngine it made)."""
    module = _load("vision_benchmark", package)
    if package == "opacus":
        monkeypatch.setattr(nn, "ReLU6", _OutOfPlaceReLU6)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [
        "vision_benchmark.py", "--device", "cpu", "-j", "0", "--architecture", "mobilenet_v2",
        "-b", str(BATCH), "--steps", str(STEPS), "--sigma", str(SIGMA), "-c", "1.0", *flags])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module.main()
    return module


@pytest.mark.slow  # about 15 s for the two runs on a shared core
def test_vision_benchmark_loader_run_is_charged_as_a_shuffle_where_opacus_charges_poisson(
        monkeypatch, tmp_path, capsys):
    """With --benchmark-data-loader the script trains the loader make_private returns, which it
    built with poisson_sampling=False over a plain DataLoader of STEPS batches: dptrain.opacus
    keeps it and charges the pass as one Gaussian mechanism of sensitivity 2 C (mu = 2 / sigma,
    no amplification); Opacus charges it as Poisson sampling at q = 1 / STEPS."""
    flags = ["--benchmark-data-loader"]  # dptrain.opacus first: the Opacus run patches nn.ReLU6
    ours = _run_vision_benchmark("dptrain.opacus", flags, monkeypatch, tmp_path)
    theirs = _run_vision_benchmark("opacus", flags, monkeypatch, tmp_path)
    assert capsys.readouterr().out.count("Speed: ") == 2  # both trained to the script's end
    (our_engine,), (their_engine,) = ours.engines, theirs.engines
    assert our_engine.accountant.history == [(SIGMA, 1 / STEPS, STEPS)]
    assert their_engine.accountant.history == [(SIGMA, 1 / STEPS, STEPS)]
    epsilon = [float(engine.accountant.get_epsilon(delta=1e-5))
               for engine in (our_engine, their_engine)]
    assert epsilon[0] == pytest.approx(_composed_gaussian_epsilon(2 / SIGMA, 1e-5), rel=1e-6)
    poisson = PRVAccountant()  # the script's accountant over Opacus's Poisson charge
    poisson.history = [(SIGMA, 1 / STEPS, STEPS)]
    assert epsilon[1] == pytest.approx(poisson.get_epsilon(1e-5), rel=1e-3)
    assert epsilon[1] < epsilon[0]


def test_vision_benchmark_default_loop_on_one_fixed_batch_is_refused(monkeypatch, tmp_path):
    """Without --benchmark-data-loader the script steps STEPS times on one batch it drew itself,
    never iterating the private loader: dptrain.opacus refuses the first step (the accountant
    would charge batches that were never sampled), where Opacus charges them."""
    with pytest.raises(PrivacyError, match="handed out no batch since the previous step"):
        _run_vision_benchmark("dptrain.opacus", [], monkeypatch, tmp_path)
