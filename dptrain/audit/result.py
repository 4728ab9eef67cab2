"""From canary scores to a verdict: the guesses, the result, audit.json and the score figure.

Guessing rules are declared before the scores are seen (`GuessingRules`): for each fraction f of
the m canaries, "top" guesses "included" for the round(f m) highest scores and abstains on the
rest; "top_and_bottom" guesses "included" for the highest half of them and "excluded" for the
lowest half. Every (fraction, side) pair is one rule; the best bound over all of them is
reported with the Bonferroni correction of `dptrain.audit.bound.best_lower_bound`. Ties between
scores are broken by canary index, never by inclusion.

Two bounds come from the same guesses: the (epsilon, delta) bound of Steinke, Nasr and
Jagielski (`dptrain.audit.bound`), on which the verdict rests, and beside it the f-DP bound of
Mahloujifar, Melis and Chaudhuri for the Gaussian-DP family (`dptrain.audit.fdp`): a lower bound
on mu and the epsilon of mu-GDP at the run's delta. Each is the best over the same rules, with
its own Bonferroni correction, and each holds at the stated confidence on its own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.audit.bound import GuessOutcome, best_lower_bound, check_confidence
from dptrain.audit.fdp import best_gdp_mu_lower_bound, mu_to_epsilon
from dptrain.errors import ConfigError
from dptrain.formatting import format_epsilon

AUDIT_FILE = "audit.json"
FIGURE_FILE = "audit_scores.png"
SIDES = ("top", "top_and_bottom")
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5)


def _lower(epsilon: float) -> str:
    """An empirical lower bound on epsilon in text: rounded down (it claims at least that)."""
    return format_epsilon(epsilon, rounding="down")


@dataclass(frozen=True)
class GuessingRules:
    """The pre-declared guessing rules: every fraction with every side (see module doc)."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    sides: tuple[str, ...] = SIDES

    def __post_init__(self) -> None:
        fractions = tuple(self.fractions)
        if not fractions or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                    and 0 < f <= 1 for f in fractions):
            raise ConfigError(f"audit.guesses={list(fractions)!r} must be a non-empty list of "
                              "fractions in (0, 1] of the canaries to guess (e.g. [0.05, 0.1]).")
        sides = tuple(self.sides)
        if not sides or any(side not in SIDES for side in sides):
            raise ConfigError(f"audit.guess_sides={list(sides)!r} must be a non-empty list of "
                              f"{list(SIDES)}.")
        object.__setattr__(self, "fractions", tuple(float(f) for f in fractions))
        object.__setattr__(self, "sides", sides)

    def counts(self, canaries: int) -> list[tuple[int, int]]:
        """(k+, k-) of every distinct rule for m canaries (rules that guess nothing dropped)."""
        rules: list[tuple[int, int]] = []
        for fraction in self.fractions:
            guesses = min(canaries, round(fraction * canaries))
            for side in self.sides:
                pair = (guesses, 0) if side == "top" else (guesses - guesses // 2, guesses // 2)
                if guesses > 0 and pair not in rules:
                    rules.append(pair)
        if not rules:
            raise ConfigError(f"audit.guesses={list(self.fractions)} guesses no canary out of "
                              f"{canaries}: use larger fractions or more canaries.")
        return rules


def count_correct(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Correct guesses when the k+ highest scores are guessed in and the k- lowest out."""
    order = np.lexsort((np.arange(len(scores)), -scores))  # by score, ties by canary index
    top, bottom = order[:k_plus], order[len(order) - k_minus:] if k_minus else order[:0]
    return int(included[top].sum() + (~included[bottom]).sum())


@dataclass(frozen=True)
class AuditResult:
    """What a one-run audit found; `verdict` is the one-line reading of it."""

    kind: str                     # "white_box" | "black_box"
    score: str                    # "all_iterates" | "last_iterate" | "loss"
    claimed_epsilon: float        # the run's proven upper bound (inf: no guarantee)
    delta: float
    lower_bound: float            # empirical epsilon lower bound at `confidence`
    confidence: float
    canaries: int                 # m
    included: int                 # canaries that were in the run
    guesses: int                  # r of the best rule
    correct: int                  # v of the best rule
    guesses_included: int         # k+ of the best rule
    guesses_excluded: int         # k- of the best rule
    correction: str = "bonferroni"
    rules: tuple[GuessOutcome, ...] = field(default=())
    fdp_mu_lower_bound: float = 0.0  # f-DP (Gaussian) bound: the run is not mu-GDP for smaller mu
    fdp_lower_bound: float = 0.0     # epsilon of that mu-GDP at `delta`
    fdp_guesses: int = 0             # r of the rule with the best f-DP bound
    fdp_correct: int = 0             # v of that rule

    @property
    def violation(self) -> bool:
        """True when the (epsilon, delta) lower bound exceeds the claimed epsilon."""
        return self.lower_bound > self.claimed_epsilon

    @property
    def fdp_exceeds_claim(self) -> bool:
        """True when the f-DP (Gaussian) lower bound exceeds the claimed epsilon: the run is
        not Gaussian-DP at the claimed epsilon (a violation for a full-batch run, which is
        exactly mu-GDP; see docs/auditing.md)."""
        return self.fdp_lower_bound > self.claimed_epsilon

    def _fdp_clause(self) -> str:
        return (f"f-DP (Gaussian) lower bound {_lower(self.fdp_lower_bound)} (mu >= "
                f"{self.fdp_mu_lower_bound:.3g})")

    @property
    def verdict(self) -> str:
        if self.violation:
            return (f"VIOLATION: the run leaked more than it claims (epsilon >= "
                    f"{_lower(self.lower_bound)} with {self.confidence:.0%} confidence, claimed "
                    f"{format_epsilon(self.claimed_epsilon)} at delta = {self.delta:.3g}; "
                    f"{self._fdp_clause()})")
        fdp = (f"{self._fdp_clause()} > claimed: not Gaussian-DP at the claimed epsilon, a "
               "violation for a full-batch run only (docs/auditing.md)"
               if self.fdp_exceeds_claim else f"{self._fdp_clause()} <= claimed")
        return (f"consistent: empirical lower bound {_lower(self.lower_bound)} <= claimed "
                f"epsilon {format_epsilon(self.claimed_epsilon)} ({self.confidence:.0%} confidence, delta = "
                f"{self.delta:.3g}); {fdp}")

    def summary(self) -> str:
        """A few lines a person can read: both bounds, the counts, the verdict."""
        return "\n".join([
            f"audit ({self.kind}, {self.score} scores): claimed epsilon "
            f"{format_epsilon(self.claimed_epsilon)} (upper bound), empirical lower bound "
            f"{_lower(self.lower_bound)} at "
            f"{self.confidence:.0%} confidence, delta = {self.delta:.3g}",
            f"  {self.canaries} canaries ({self.included} included); best rule: {self.correct} "
            f"of {self.guesses} guesses correct ({self.guesses_included} top, "
            f"{self.guesses_excluded} bottom; {len(self.rules)} rules, {self.correction})",
            f"  f-DP (Gaussian, Mahloujifar et al.): mu >= {self.fdp_mu_lower_bound:.4g}, "
            f"epsilon >= {_lower(self.fdp_lower_bound)} at delta = {self.delta:.3g} (best rule: "
            f"{self.fdp_correct} of {self.fdp_guesses} correct)",
            f"  {self.verdict}",
        ])

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["rules"] = [{**asdict(rule), "guesses": rule.guesses} for rule in self.rules]
        return {**record, "violation": self.violation,
                "fdp_exceeds_claim": self.fdp_exceeds_claim, "verdict": self.verdict}


def audit_scores(scores: np.ndarray, included: np.ndarray, *, kind: str, score: str,
                 claimed_epsilon: float, delta: float, confidence: float = 0.95,
                 rules: GuessingRules | None = None,
                 out_dir: Path | str | None = None) -> AuditResult:
    """The audit's result from the canaries' scores (float [m]) and inclusion (bool [m]).

    With `out_dir`, also writes audit.json and the score figure there (`write_audit`).
    """
    confidence = check_confidence(confidence, "audit.confidence")
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ConfigError(f"scores {scores.shape} and inclusion {included.shape} must be two "
                          "vectors with one entry per canary.")
    if not np.isfinite(scores).all():
        raise ConfigError("some canary scores are not finite (nan or inf): the run diverged; "
                          "nothing can be concluded from them.")
    if not (isinstance(claimed_epsilon, (int, float)) and claimed_epsilon >= 0):
        raise ConfigError(f"claimed_epsilon={claimed_epsilon!r} must be >= 0 (the run's "
                          "epsilon; inf for no guarantee).")
    m = len(scores)
    counts = (rules or GuessingRules()).counts(m)
    outcomes = [(k_plus, k_minus, count_correct(scores, included, k_plus, k_minus))
                for k_plus, k_minus in counts]
    best, all_rules = best_lower_bound(m, outcomes, delta, confidence)
    fdp_best, mus = best_gdp_mu_lower_bound(m, outcomes, confidence)
    all_rules = tuple(replace(rule, fdp_mu_lower_bound=mu, fdp_lower_bound=mu_to_epsilon(mu, delta))
                      for rule, mu in zip(all_rules, mus))
    fdp_rule = all_rules[fdp_best]
    result = AuditResult(kind=kind, score=score, claimed_epsilon=float(claimed_epsilon),
                         delta=float(delta), lower_bound=best.lower_bound, confidence=confidence,
                         canaries=m, included=int(included.sum()), guesses=best.guesses,
                         correct=best.correct, guesses_included=best.guesses_included,
                         guesses_excluded=best.guesses_excluded, rules=all_rules,
                         fdp_mu_lower_bound=fdp_rule.fdp_mu_lower_bound,
                         fdp_lower_bound=fdp_rule.fdp_lower_bound,
                         fdp_guesses=fdp_rule.guesses, fdp_correct=fdp_rule.correct)
    if out_dir is not None:
        write_audit(result, scores, included, out_dir)
    return result


def write_audit(result: AuditResult, scores: np.ndarray, included: np.ndarray,
                out_dir: Path | str) -> Path:
    """Write `audit.json` (the result, every canary's score and inclusion) and the score
    histogram `audit_scores.png` into `out_dir`; returns the path of audit.json."""
    from dptrain.io import atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = plot_scores(result, np.asarray(scores, float), np.asarray(included, bool),
                        out / FIGURE_FILE)
    record = {**result.to_dict(), "figure": FIGURE_FILE if drawn else None,
              "canary_scores": [float(s) for s in scores],
              "canary_included": [bool(i) for i in included]}
    path = out / AUDIT_FILE
    atomic_write_json(path, record)
    return path


def plot_scores(result: AuditResult, scores: np.ndarray, included: np.ndarray,
                path: Path) -> bool:
    """Histogram of the scores of included vs excluded canaries, with the verdict as title.

    Returns False (with a warning) when matplotlib, an optional dependency, is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("the audit figure needs matplotlib (pip install 'dptrain[audit]'); "
                      "audit.json is written without it.", UserWarning, stacklevel=3)
        return False
    bins = np.histogram_bin_edges(scores, bins=min(60, max(10, int(math.sqrt(len(scores))))))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(scores[~included], bins=bins, alpha=0.6, label=f"excluded ({int((~included).sum())})")
    ax.hist(scores[included], bins=bins, alpha=0.6, label=f"included ({int(included.sum())})")
    ax.set_xlabel(f"canary score ({result.score})")
    ax.set_ylabel("canaries")
    ax.set_title(f"{'VIOLATION' if result.violation else 'consistent'}: lower bound "
                 f"{_lower(result.lower_bound)} (f-DP {_lower(result.fdp_lower_bound)}) vs "
                 f"claimed epsilon {format_epsilon(result.claimed_epsilon)}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
