"""Batch-selection strategies, one module each, and their registry (see base.py for what a
strategy owns). The registration lines below are the only list of schemes:

    poisson         each example in each batch with probability q (amplified, add/remove)
    shuffle         fixed-size batches of one shuffle per epoch (substitution, no amplification)
    cyclic_poisson  groups drawn once, group t mod b Poisson-sampled at step t (banded noise)
    balls_in_bins   each example in one uniformly random batch of each epoch (random allocation)
    given           the caller's loader, charged as Poisson (no proof; make_private only)
    given_shuffle   the caller's loader, one example per batch per pass (charged as shuffle)
"""

from __future__ import annotations

from typing import Any, Mapping

from dptrain.checks import check_sample_rate
from dptrain.privacy.selection.balls_in_bins import BallsInBins
from dptrain.privacy.selection.base import (
    LoaderContext,
    Selection,
    correlated,
    noise_bands,
    register_selection,
    selection_class,
    selection_kinds,
)
from dptrain.privacy.selection.cyclic_poisson import CyclicPoisson
from dptrain.privacy.selection.given import Given, GivenShuffle
from dptrain.privacy.selection.poisson import Poisson
from dptrain.privacy.selection.shuffle import Shuffle

register_selection(Poisson)
register_selection(Shuffle)
register_selection(CyclicPoisson)
register_selection(Given)
register_selection(GivenShuffle)
register_selection(BallsInBins)

#: the selection of a plan that names none, and the one that groups (groups given, or preferred
#: by the noise)
DEFAULT_KIND = Poisson.kind
GROUPED_KIND = CyclicPoisson.kind


def default_selection(noise_kind: str, sample_rate: float, kind: str | None = None,
                      groups: int | None = None, schedule: Mapping[str, Any] | None = None,
                      bands: int | None = None) -> Selection:
    """The batch selection for noise of `noise_kind` (a dptrain.privacy.noise kind; `bands` b
    when banded) with `kind` and `groups` as the user gave them (None: not given).

    The one rule for a missing selection: the noise strategy prefers a number of groups
    (`preferred_groups`: banded noise of b bands b, so that each example takes part at most once
    every b steps, the amplified accounting of banded MF; BLT floor(1 / q), about once per epoch,
    the min-separation schema it is optimised for; independent noise 1). More than one group
    means cyclic Poisson sampling, else Poisson. Groups given without a kind mean cyclic Poisson;
    cyclic Poisson without groups takes the preferred number."""
    from dptrain.privacy.noise import noise_class  # the noise registry (no import cycle)

    preferred = noise_class(noise_kind).preferred_groups(check_sample_rate(sample_rate), bands)
    if kind is None:
        grouped = (groups is not None and groups != 1) or preferred != 1
        kind = GROUPED_KIND if grouped else DEFAULT_KIND
    cls = selection_class(kind)
    if groups is None:
        groups = preferred if cls.takes_groups else 1
    return cls(sample_rate=sample_rate, kind=kind, schedule=schedule, groups=groups)


__all__ = ["BallsInBins", "CyclicPoisson", "DEFAULT_KIND", "GROUPED_KIND", "Given",
           "GivenShuffle", "LoaderContext", "Poisson", "Selection", "Shuffle", "correlated",
           "default_selection", "noise_bands", "register_selection", "selection_class",
           "selection_kinds"]
