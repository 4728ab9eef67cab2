"""The seam between noise strategies and the accountants: which combinations are charged.

A correlated-noise run charged as independent DP-SGD would report a wrong epsilon, so the engine
(and the calibration of sigma) first asks `require_accounting` whether the plan's accountant
charges its (noise strategy, batch selection) pair exactly. Today only independent noise is:
the matrix-factorization accounting (dptrain.accounting.matrix_factorization: banded noise with
cyclic Poisson sampling, amplified; BLT or banded noise with fixed participation, by its
sensitivity) registers its pairs in `ACCOUNTED` when it exists, and checks its own conditions
(e.g. at least b groups for b bands) in the plan.
"""

from __future__ import annotations

from dptrain.errors import ConfigError

#: (privacy.noise, privacy.sampling) pairs whose epsilon the accountants compute exactly.
ACCOUNTED: set[tuple[str, str]] = {("independent", kind)
                                   for kind in ("poisson", "shuffle", "given")}


def require_accounting(noise: str, selection: str) -> None:
    """ConfigError unless noise strategy `noise` with batch selection `selection` is accounted
    (`ACCOUNTED`): a run is never charged for another mechanism than the one it runs."""
    if (noise, selection) in ACCOUNTED:
        return
    supported = sorted(s for n, s in ACCOUNTED if n == noise)
    hint = (f"It is accounted with privacy.sampling in {supported}."
            if supported else "This dptrain cannot account it with any batch selection yet.")
    raise ConfigError(
        f"privacy.noise={noise} with privacy.sampling={selection} has no privacy accounting: "
        f"charging its steps as independent DP-SGD would report a wrong epsilon. {hint} Use "
        "privacy.noise=independent (noise_strategy=Independent()) to train with DP-SGD.")
