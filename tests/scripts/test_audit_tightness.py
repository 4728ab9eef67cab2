"""Smoke test of scripts/audit_tightness.py on tiny settings (no tightness assertions)."""

import importlib.util
import sys
from pathlib import Path

import pytest

# The script seeds its noise and sampling (reproducible_mechanism=True) so that its measurements
# repeat.
pytestmark = pytest.mark.filterwarnings("ignore:The noise is reproducible:UserWarning")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "audit_tightness.py"


@pytest.fixture(scope="module")
def tightness():
    spec = importlib.util.spec_from_file_location("audit_tightness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["audit_tightness"] = module
    spec.loader.exec_module(module)
    return module


def test_gaussian_setting_gives_both_ratios_between_zero_and_one(tightness) -> None:
    snj, fdp = tightness.gaussian_ratio(4.0, canaries=200, seed=0)
    assert 0 <= snj <= 1 and 0 <= fdp <= 1


def test_dpsgd_setting_gives_both_ratios_between_zero_and_one(tightness) -> None:
    snj, fdp = tightness.dpsgd_ratio(4.0, canaries=100, seed=0, sample_rate=1.0, steps=2,
                                     features=20, size=40)
    assert 0 <= snj <= 1 and 0 <= fdp <= 1
