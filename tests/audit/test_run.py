"""Whole audits of tiny private runs: a correct mechanism is consistent, planted bugs are caught.

The planted bugs (audit_helpers: a clipper that does not clip, noise 10x too small, an accountant
told q / 10) are test builds of the mechanism; the shipped optimizer is never changed.
"""

import json

import pytest
from audit_helpers import (
    DELTA,
    UnderCountingEngine,
    plant_no_clipping,
    plant_too_little_noise,
    private_linear_run,
    random_classification,
)

from dptrain.audit import MislabeledCanaries, audit_scores, one_run
from dptrain.errors import ConfigError
from dptrain.privacy.engine import PrivacyEngine

# The runs seed their noise and sampling (reproducible_mechanism=True) so that every audit
# repeats exactly.
pytestmark = pytest.mark.filterwarnings("ignore:The noise is reproducible:UserWarning")

CANARIES = 1000  # the linear model has 5010 coordinates


def _audit(run, **kwargs):
    return one_run(run.train, engine=run.engine, delta=DELTA, canaries=CANARIES, **kwargs)


@pytest.mark.parametrize("seed", range(5))
def test_a_correct_run_is_consistent_whatever_the_seed(seed):
    # Both bounds: the (epsilon, delta) one and the f-DP (Gaussian) one stay below the claim.
    result = _audit(private_linear_run(noise_multiplier=1.5, steps=100, seed=seed), seed=seed)
    assert 0 < result.lower_bound <= result.claimed_epsilon
    assert result.lower_bound <= result.fdp_lower_bound <= result.claimed_epsilon
    assert not result.fdp_exceeds_claim
    assert result.verdict.startswith("consistent")


def test_white_box_all_iterates_comes_within_a_factor_four_of_the_claimed_epsilon():
    result = _audit(private_linear_run(noise_multiplier=1.5, steps=100))
    assert result.claimed_epsilon == pytest.approx(3.55, abs=0.05)
    assert result.lower_bound / result.claimed_epsilon >= 0.25
    assert result.fdp_lower_bound / result.claimed_epsilon >= 0.3


def test_planted_bug_a_clipper_that_does_not_clip_is_a_violation():
    result = _audit(plant_no_clipping(private_linear_run(noise_multiplier=3.0, steps=50)))
    assert result.lower_bound > result.claimed_epsilon
    assert result.violation and result.fdp_exceeds_claim
    assert result.verdict.startswith("VIOLATION: the run leaked more than it claims")


def test_planted_bug_noise_ten_times_too_small_is_a_violation():
    result = _audit(plant_too_little_noise(private_linear_run(noise_multiplier=3.0, steps=50)))
    assert result.lower_bound > result.claimed_epsilon
    assert result.verdict.startswith("VIOLATION")


def test_planted_bug_accounting_with_a_ten_times_too_small_sample_rate_is_a_violation():
    run = private_linear_run(noise_multiplier=1.5, steps=200, engine_class=UnderCountingEngine)
    result = _audit(run)
    assert result.lower_bound > result.claimed_epsilon
    assert result.verdict.startswith("VIOLATION")


def _black_box(*, noise_multiplier, plant=None, seed=0):
    data = random_classification(400, 200, seed)
    canaries = MislabeledCanaries(data, 200, num_classes=10, seed=seed)
    run = private_linear_run(noise_multiplier=noise_multiplier, steps=300, seed=seed,
                             features=200, dataset=canaries.training_set())
    if plant is not None:
        plant(run)
    run.train()
    return audit_scores(canaries.scores(run.model), canaries.included.numpy(), kind="black_box",
                        score="loss", claimed_epsilon=run.engine.get_epsilon(DELTA), delta=DELTA)


def test_black_box_audit_of_a_correct_run_is_consistent():
    result = _black_box(noise_multiplier=5.0)
    assert result.lower_bound <= result.claimed_epsilon


def test_black_box_audit_catches_noise_ten_times_too_small():
    result = _black_box(noise_multiplier=5.0, plant=plant_too_little_noise)
    assert result.violation


def test_one_run_writes_audit_json_and_the_score_figure(tmp_path):
    result = _audit(private_linear_run(noise_multiplier=1.5, steps=20), out_dir=tmp_path)
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["lower_bound"] == pytest.approx(result.lower_bound)
    assert record["claimed_epsilon"] == pytest.approx(result.claimed_epsilon)
    assert record["canaries"] == CANARIES and len(record["canary_scores"]) == CANARIES
    assert record["verdict"] == result.verdict and record["correction"] == "bonferroni"
    assert record["fdp_lower_bound"] == pytest.approx(result.fdp_lower_bound)
    assert (tmp_path / "audit_scores.png").read_bytes().startswith(b"\x89PNG")


def test_one_run_needs_an_engine_that_made_a_run_private():
    with pytest.raises(ConfigError, match="make_private"):
        one_run(lambda: None, engine=PrivacyEngine(), delta=DELTA)
