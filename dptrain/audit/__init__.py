"""Empirical privacy auditing in one training run (Steinke, Nasr and Jagielski, NeurIPS 2023).

A run claims (epsilon, delta)-DP; an audit inserts canaries, trains once, guesses which canaries
were included, and turns the number of correct guesses into a lower bound on the epsilon the run
actually has. A lower bound above the claimed epsilon is a violation: a bug in clipping, noise,
sampling or accounting. See docs/auditing.md.

    bound.py     the theorem: p-values, the epsilon lower bound, the Bonferroni best-of-k
    fdp.py       the f-DP analysis (Mahloujifar, Melis, Chaudhuri 2024): a Gaussian-DP mu bound
    canaries.py  white-box Dirac gradient canaries, black-box mislabeled examples, their scores
    result.py    guessing rules, AuditResult and its verdict, audit.json and the score figure
    run.py       one_run: audit a run made by make_private in one call
"""

from dptrain._lazy import lazy_attributes

_PUBLIC = {
    "one_run": "dptrain.audit.run",
    "AuditResult": "dptrain.audit.result",
    "GuessingRules": "dptrain.audit.result",
    "audit_scores": "dptrain.audit.result",
    "write_audit": "dptrain.audit.result",
    "DiracCanaries": "dptrain.audit.canaries",
    "MislabeledCanaries": "dptrain.audit.canaries",
    "epsilon_lower_bound": "dptrain.audit.bound",
    "fdp_epsilon_lower_bound": "dptrain.audit.fdp",
    "gdp_mu_lower_bound": "dptrain.audit.fdp",
    "p_value": "dptrain.audit.bound",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_attributes(__name__, _PUBLIC)
