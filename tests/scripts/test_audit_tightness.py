"""Smoke test of scripts/audit_tightness.py on tiny settings (no tightness assertions)."""


import pytest
from script_loader import load_script

# The script seeds its noise and sampling (reproducible_mechanism=True) so that its measurements
# repeat.
pytestmark = pytest.mark.filterwarnings("ignore:The noise is reproducible:UserWarning")


@pytest.fixture(scope="module")
def tightness():
    return load_script("audit_tightness")


def test_gaussian_setting_gives_both_ratios_between_zero_and_one(tightness) -> None:
    snj, fdp = tightness.gaussian_ratio(4.0, canaries=200, seed=0)
    assert 0 <= snj <= 1 and 0 <= fdp <= 1


def test_dpsgd_setting_gives_both_ratios_between_zero_and_one(tightness) -> None:
    snj, fdp = tightness.dpsgd_ratio(4.0, canaries=100, seed=0, sample_rate=1.0, steps=2,
                                     features=20, size=40)
    assert 0 <= snj <= 1 and 0 <= fdp <= 1
