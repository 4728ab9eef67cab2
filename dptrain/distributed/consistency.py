"""Cross-rank checks: every rank must train the same job, or every rank stops with one message.

A distributed DP run is only private if every rank applies the same mechanism: the same clipping
norm C (rank 0's noise is calibrated to it), the same noise multiplier, the same sample rate and
dataset size. A rank with a larger C, or sharding a different dataset, would silently break the
guarantee; a rank with another model shape would hang the all-reduce. So the objects that fix the
mechanism (the CLI's resolved config, the private loader, the DP optimizer) compare what they were
given across ranks when they are built.

`check_same_on_every_rank` is ONE collective (an all_gather of the values): every rank sees every
rank's values, so every rank raises the same error or none does; no rank is left waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from typing import Any

from dptrain.distributed.runtime import all_gather_objects
from dptrain.errors import ConfigError

MAX_LISTED_KEYS = 5
#: Config keys that may differ across ranks: where each node reads its own copy of the data.
RANK_LOCAL_CONFIG_KEYS = ("dataset.root",)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys: {"a": {"b": 1}} -> {"a.b": 1} (empty mappings kept)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def digest(values: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of `values` (flattened, keys sorted)."""
    canonical = json.dumps(flatten(values), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<missing>") != fb.get(k, "<missing>"))


def check_same_on_every_rank(values: Mapping[str, Any], what: str, fix: str,
                             ignore: Collection[str] = (), group: Any = None) -> None:
    """ConfigError on EVERY rank unless every rank's `values` equal rank 0's.

    Args:
        values: what must agree, a (nested) mapping of picklable, JSON-printable values.
        what: how the message names them ("the config", "make_private's arguments").
        fix: the sentence telling the user what to do.
        ignore: dotted keys left out of the comparison.
        group: the process group (default: the world). A no-op on one process.

    The message names the ranks that differ from rank 0 and the differing keys (at most
    MAX_LISTED_KEYS of them).
    """
    mine = {k: v for k, v in flatten(values).items() if k not in ignore}
    gathered = all_gather_objects((digest(mine), mine), group=group)
    reference_digest, reference = gathered[0]
    bad = [(rank, other) for rank, (d, other) in enumerate(gathered) if d != reference_digest]
    if not bad:
        return
    keys = sorted({k for _, other in bad for k in _differing_keys(reference, other)})
    shown = ", ".join(keys[:MAX_LISTED_KEYS]) + (", ..." if len(keys) > MAX_LISTED_KEYS else "")
    raise ConfigError(f"{what} of rank(s) {[rank for rank, _ in bad]} differs from rank 0's in "
                      f"{shown}: {fix} Nothing was trained.")


def check_same_config(config: Mapping[str, Any], group: Any = None) -> None:
    """The CLI's check: every rank's resolved config equals rank 0's (RANK_LOCAL_CONFIG_KEYS
    aside), else ConfigError on every rank naming the ranks and keys."""
    check_same_on_every_rank(
        config, "the config", "every process of a hardware=ddp run must get the same overrides "
        "(same command line and config files on every node).",
        ignore=RANK_LOCAL_CONFIG_KEYS, group=group)
