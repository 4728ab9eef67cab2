"""Reading and checking a ledger: the claimed epsilon is always `epsilon_of` its stored history
(so it can be recomputed), `load_ledger` validates the schema and the cross-field rules,
`verify_ledger` recomputes the claim and cross-checks the records beside the ledger;
`charged_beyond_completed` says why a ledger charges steps it does not know finished."""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.accounting import ACCOUNTANTS, compute_epsilon, get_accountant
from dptrain.accounting.events import AccountingEvent
from dptrain.accounting.history import History, history_from_json, history_steps
from dptrain.errors import ConfigError
from dptrain.privacy.plan import PrivacyPlan
from dptrain.train.ledger.hashing import config_hash
from dptrain.train.ledger.schema import (
    LEDGER_FILENAME,
    NON_PRIVATE_NOTE,
    SCHEMA_VERSION,
    schema_errors,
)
from dptrain.train.ledger_check import edited_ledger_error, first_mismatch, record_mismatches

def epsilon_of(history: History, delta: float, accountant: str,
               sampling: str | AccountingEvent = "poisson") -> float:
    """Epsilon of `history` at `delta` under `accountant` for steps charged as `sampling`
    (poisson | shuffle, or the plan's AccountingEvent: `ledger_sampling`); 0.0 for an empty
    history.

    Memoized (the ledger, the guard and the metrics ask for the same histories repeatedly).
    """
    if not history:
        return 0.0
    key = tuple((float(s), float(q), int(n)) for s, q, n in history)
    return _cached_epsilon(key, float(delta), accountant, sampling)


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(history: tuple[tuple[float, float, int], ...], delta: float,
                    accountant: str, sampling: str | AccountingEvent) -> float:
    return float(compute_epsilon(list(history), delta, accountant=accountant, sampling=sampling))


def ledger_sampling(data: dict[str, Any]) -> str | AccountingEvent:
    """How a ledger's history is charged: the recorded plan's AccountingEvent (its selection,
    sampling groups and noise strategy, rebuilt from the strategy's recorded parameters), or
    "poisson" for a ledger without a plan (a version-1 ledger's runs used Poisson sampling)."""
    plan = data.get("plan")
    if not plan:
        return "poisson"
    return PrivacyPlan.from_dict(plan).accounting


def ledger_accountant(data: dict[str, Any], name: str) -> Any:
    """An empty accountant of `name` charging steps as the ledger's plan does (shuffled batches
    and balls-in-bins: the selection's own accountant, carrying the name): what its `guarantee`
    and `approximate` say of that name's claim."""
    return get_accountant(name, ledger_sampling(data))


def accounting_record(data: dict[str, Any], history: History) -> dict[str, Any] | None:
    """What the ledger records of how its history is charged when that is not plain DP-SGD
    (cyclic Poisson sampling or correlated noise): the selection, groups, neighbouring
    relation, whether amplified, the sensitivity of the noise strategy (units of clip) and the
    participation schema (dptrain.accounting.events.AccountingEvent.describe); None otherwise."""
    event = ledger_sampling(data)
    if not isinstance(event, AccountingEvent) or event.plain:
        return None
    key = tuple((float(s), float(q), int(n)) for s, q, n in history)
    return copy.deepcopy(_cached_describe(event, key))


@functools.lru_cache(maxsize=256)
def _cached_describe(event: AccountingEvent,
                     history: tuple[tuple[float, float, int], ...]) -> dict[str, Any]:
    return event.describe(list(history))


def accounting_mismatches(data: dict[str, Any], history: History) -> list[str]:
    """The recorded `accounting` (sensitivity, participation schema) where it differs from the
    one recomputed from the recorded plan and history, as one "accounting: ..." line; []
    when they agree (or neither is recorded)."""
    recorded, recomputed = data.get("accounting"), accounting_record(data, history)
    if recorded is None and recomputed is None:
        return []
    if recorded is not None and recomputed is not None and all(
            _same_value(recorded.get(k), v) for k, v in recomputed.items()):
        return []
    return [f"accounting: records {recorded!r}, the plan and history give {recomputed!r}"]


def _same_value(a: Any, b: Any) -> bool:
    """Equal JSON values, floats to a relative 1e-9."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def available_accountants() -> list[str]:
    """Names of the registered accountants (dptrain.accounting.ACCOUNTANTS)."""
    return sorted(ACCOUNTANTS)


def _as_float(value: Any) -> float | None:
    """Read back an epsilon written by `dptrain.io` ("inf" strings become floats)."""
    if value is None:
        return None
    return float(value)


def consistency_errors(data: dict[str, Any]) -> list[str]:
    """Cross-field checks the schema cannot express (step counts, config hash)."""
    errors: list[str] = []
    total = history_steps(history_from_json(data["history"]))
    if data["private"] and data["steps_completed"] + data["committed_ahead"] != total:
        errors.append(f"steps_completed ({data['steps_completed']}) + committed_ahead "
                      f"({data['committed_ahead']}) != steps in history ({total})")
    if config_hash(data["config"]) != data["config_hash"]:
        errors.append("config_hash does not match the config stored in the ledger")
    if data["private"] and (data["accountant"] is None or data["delta"] is None):
        errors.append("a private ledger needs an accountant and a delta")
    return errors


def charged_beyond_completed(data: dict[str, Any]) -> str | None:
    """Why a private ledger charges steps it does not know finished (`committed_ahead` > 0), as
    one clause: "N steps charged beyond the M that finished: ..."; None when it charges none
    beyond them (or is not private). Steps are committed before their batches are drawn (in
    blocks: dptrain.train.budget); a run that stops keeps the committed steps (every one whose
    batch may have been drawn), and a killed process leaves its whole block."""
    ahead = int(data.get("committed_ahead") or 0)
    if not data.get("private") or ahead <= 0:
        return None
    if data.get("status") == "running":
        how = ("by a process that is still running, or was killed before it could record how "
               "far it got")
    else:
        how = f"and kept when the run stopped ({str(data.get('status')).replace('_', ' ')})"
    steps, batches = ("1 step", "its batch was") if ahead == 1 else (f"{ahead} steps",
                                                                       "their batches were")
    return (f"{steps} charged beyond the {data['steps_completed']} that finished: committed to "
            f"the ledger before {batches} drawn (a step is charged before it touches the data) "
            f"{how}")


def load_ledger(path: Path | str, check_records: bool = False) -> dict[str, Any]:
    """Read and validate a ledger file (or a run folder holding one).

    Raises ConfigError naming the file when it is missing, truncated, not JSON, of another schema
    version or inconsistent, and with `check_records` when a record of the run shows more steps
    or epsilon than its history (`records_beyond_history`); the file is never modified.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LEDGER_FILENAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"No privacy ledger at {str(path)!r}: pass a run folder or its "
                          f"{LEDGER_FILENAME}.") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"The privacy ledger {str(path)!r} is corrupt or truncated ({err}); "
                          "it cannot be trusted. Restore it from a backup, or start a new run "
                          "in a new folder (hydra.run.dir); the steps it recorded are spent, "
                          "and a run without it would not count them.") from err
    problems = schema_errors(data)
    if not problems:
        problems = consistency_errors(data)
    if problems:
        raise ConfigError(f"The privacy ledger {str(path)!r} does not match schema version "
                          f"{data.get('schema_version', SCHEMA_VERSION)}: " + "; ".join(problems[:5]) + ". It was written by "
                          "another dptrain version or edited by hand; it cannot be verified.")
    mismatches = records_beyond_history(path, data) if check_records else []
    if mismatches:
        raise edited_ledger_error(path, mismatches)
    return data


def records_beyond_history(path: Path | str, data: dict[str, Any]) -> list[str]:
    """The records of the run (dptrain.train.ledger_check: the ledger's checkpoint entries and
    resumes, metrics.jsonl and result.json beside the ledger file `path`) that show more steps,
    or a larger epsilon under the run's accountant, than the ledger `data`'s history; [] for a
    non-private ledger (it claims no epsilon)."""
    if not data["private"]:
        return []
    path = Path(path)
    run_dir = path if path.is_dir() else path.parent
    history = history_from_json(data["history"])
    return record_mismatches(run_dir, data, history_steps(history),
                             epsilon_of(history, data["delta"], data["accountant"],
                                        ledger_sampling(data)))


@dataclass
class Verification:
    """Result of re-computing a ledger's epsilon with one accountant."""

    path: Path
    accountant: str | None
    claimed: float | None        # the ledger's claim for that accountant (None: no claim)
    recomputed: float | None     # compute_epsilon(history, delta, accountant)
    ok: bool
    message: str
    # the run's records showing more steps or epsilon than the history (records_beyond_history)
    records: list[str] = field(default_factory=list)
    # why the history charges steps not known to have finished (charged_beyond_completed)
    note: str | None = None


def _claim_for(data: dict[str, Any], accountant: str) -> float | None:
    if accountant == data["accountant"]:
        return _as_float(data["epsilon"])
    entry = data["epsilon_by_accountant"].get(accountant)
    return None if entry is None else _as_float(entry["epsilon"])


def verify_ledger(path: Path | str, accountant: str | None = None,
                  rel_tol: float = 1e-6) -> Verification:
    """Recompute epsilon from a ledger's history, compare with what it claims, and check the
    history against the run's other records.

    `accountant=None` uses the run's accountant. `ok` is False when the claim differs from the
    recomputation by more than `rel_tol` (relative), or when a record of the run (its checkpoint
    entries, resumes, metrics.jsonl, result.json: `records_beyond_history`) shows more steps or
    epsilon than the history. A non-private ledger is ok with no epsilon. `note` says why
    the ledger charges steps not known to have finished (`charged_beyond_completed`), if it does.
    """
    data = load_ledger(path)
    path = Path(path)
    if not data["private"]:
        return Verification(path, None, None, None, True, NON_PRIVATE_NOTE)
    name = accountant or data["accountant"]
    if name not in available_accountants():
        raise ConfigError(f"Unknown accountant {name!r} (--accountant); choose one of "
                          f"{available_accountants()}.")
    history = history_from_json(data["history"])
    recomputed = epsilon_of(history, data["delta"], name, ledger_sampling(data))
    claimed = _claim_for(data, name)
    records = records_beyond_history(path, data) + accounting_mismatches(data, history)
    if claimed is None:
        message = f"no claim under {name!r} in the ledger; recomputed only"
        same = True
    else:
        same = (claimed == recomputed) or math.isclose(claimed, recomputed, rel_tol=rel_tol,
                                                       abs_tol=0.0)
        message = ("matches" if same else
                   f"MISMATCH: claims {claimed!r}, history gives {recomputed!r}")
    if records:
        message = (f"{message}; " if not same else "") + f"MISMATCH: {first_mismatch(records)}"
    return Verification(path, name, claimed, recomputed, same and not records, message, records,
                        charged_beyond_completed(data))
