"""The sweep ledger: what releasing the best job of a sweep costs, `sweep_ledger.json` at its root.

Every job of a sweep trains on the same private data, and the sweep table invites releasing the
job with the best validation or test accuracy: that choice depends on every job, so it costs more
than the chosen job's epsilon. `sweep_cost` reads each job folder's privacy ledger and states

* `all_composed`: every job's history composed, at the sweep's delta; an upper bound for releasing
  any job chosen in any way from the sweep. Poisson-sampled histories are concatenated under the
  jobs' accountant; a sweep with a balls-in-bins job (random allocation) adds the jobs' RDP curves
  in each direction of add/remove (dptrain.accounting.tuning.composed_rdp_epsilon). How a job's
  steps compose is its selection's entry in dptrain.accounting.selections (`pooled`, `rdp`); a
  job charged otherwise (shuffled batches, correlated noise, cyclic groups) makes it unknown;
* `random_stopping` (only for a sweep run by `dptrain tune`, whose `tuning.json` records the
  distribution of its random number K of trials and the K trials drawn): the bound of Papernot and
  Steinke (dptrain.accounting.tuning) for releasing only the best trial, computed by the RDP
  accountant (each curve the larger of the two directions of add/remove); the per-trial bound is
  the worst RDP curve over every grid point's planned cost
  (`grid_costs`, recorded by `dptrain tune` before the draw: a grid point that was not drawn
  could have been) and every job that ran; it holds once all K trials have run (a tuning.json
  without `grid_costs` keeps the old rule, the worst job that ran, with a `caveat`);
* `epsilon`: the smaller of the two that hold (the composition holds for the K jobs that ran, K
  being drawn independently of the data; the random-stopping bound over the draw of K).

Both are stated for one privacy unit (`privacy_unit`): a sweep whose jobs protect one user
(privacy.unit=user) and one example alike has no total (None, with the reason: a user-level
bound would need group privacy over the most examples one user holds, which no ledger records).

A job folder without a ledger never took a step (steps are committed to the ledger before they
touch data) and costs nothing, unless its result.json reports steps (a removed ledger); a
non-private job, or a ledger that cannot be read or was removed, makes the cost infinite or
unknown (never left out). `write_sweep_ledger` writes the file atomically;
`verify_sweep_ledger` (`dptrain-ledger SWEEP_FOLDER`) recomputes it from the jobs' ledgers.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.accounting.history import (
    History,
    history_from_json,
    history_steps,
    merge_history,
    truncate_history,
)
from dptrain.accounting.selections import (
    SelectionAccounting,
    composable_selections,
    selection_accounting,
)
from dptrain.accounting.tuning import (
    Trials,
    composed_epsilon,
    composed_rdp_epsilon,
    repeat_and_select_epsilon,
)
from dptrain.errors import DPTrainError, PrivacyError
from dptrain.formatting import format_epsilon
from dptrain.io import atomic_write_json
from dptrain.privacy.unit import Unit, unit_class, unit_described

SWEEP_LEDGER_FILENAME = "sweep_ledger.json"
TUNING_FILENAME = "tuning.json"      # written by `dptrain tune` before its first trial
# 2: a sweep with balls-in-bins jobs is composed (version 1 stated it unknown: `_differences`)
SWEEP_LEDGER_VERSION = 2
TUNING_ACCOUNTANT = "rdp"            # the random-stopping theorems are Renyi-DP bounds
# how a record written before dptrain recorded the sampling was charged (a version-1 ledger's
# mechanism, a tuning.json grid point): Poisson DP-SGD, then the only scheme
UNRECORDED_SAMPLING = "poisson"
RELATIVE_TOLERANCE = 1e-6
ALL_COMPOSED_NOTE = ("every job's history composed: holds for releasing any job of the sweep, "
                     "chosen in any way (by validation or test accuracy...)")
RDP_COMPOSITION = ("the jobs' RDP curves added in each direction of add/remove (Poisson: the "
                   "sampled Gaussian's; balls-in-bins: random allocation's), each converted at "
                   "delta, the larger epsilon")
RANDOM_STOPPING_NOTE = ("Papernot and Steinke (ICLR 2022): holds for releasing only the best of "
                        "the K trials, K drawn at random as recorded in tuning.json, each trial "
                        "bounded by the worst RDP curve it could have had")
GRID_NOTE = ("the worst RDP curve over every grid point's planned cost (tuning.json grid_costs, "
             "fixed before the draw) and every trial that ran: an undrawn grid point is covered")


def _relative(sweep_dir: Path, path: Path) -> str:
    return str(path.relative_to(sweep_dir))


def history_sha256(history: list[dict[str, Any]]) -> str:
    """SHA-256 (hex) of a ledger's history in canonical JSON (what the cost depends on)."""
    return hashlib.sha256(json.dumps(history, sort_keys=True).encode("utf-8")).hexdigest()


def _job_entry(sweep_dir: Path, job_dir: Path
               ) -> tuple[dict[str, Any], History | None, SelectionAccounting | None]:
    """A job's line in the sweep ledger, its history (None when it is not private or its
    ledger cannot be read: the sweep's cost is then infinite or unknown) and how its steps are
    charged (`_charge`; None without a readable private ledger)."""
    from dptrain.cli.results import read_result
    from dptrain.train.ledger import LEDGER_FILENAME, load_ledger

    path = job_dir / LEDGER_FILENAME
    entry: dict[str, Any] = {"job": _relative(sweep_dir, job_dir), "ledger": None}
    if not path.exists():
        steps = (read_result(job_dir) or {}).get("steps") or 0
        if steps:   # the job trained: its ledger was removed, its cost cannot be recomputed
            entry["error"] = f"its result.json reports {steps} steps but it has no {LEDGER_FILENAME}"
            return entry, None, None
        entry["note"] = "no privacy ledger: the job took no step and costs nothing"
        return entry, [], None
    entry["ledger"] = _relative(sweep_dir, path)
    try:
        data = load_ledger(path)
    except DPTrainError as error:
        entry["error"] = " ".join(str(error).split())
        return entry, None, None
    entry.update(status=data["status"], private=data["private"], accountant=data["accountant"],
                 sampling=_charged_as(data), unit=_unit_of(data),
                 delta=data["delta"], epsilon=data["epsilon"],
                 steps=data["steps_completed"] + data["committed_ahead"],
                 history_sha256=history_sha256(data["history"]))
    if not data["private"]:
        return entry, None, None
    return entry, history_from_json(data["history"]), _charge(data)


def _charge(data: dict[str, Any]) -> SelectionAccounting | None:
    """How a private job's steps are charged, from the accounting registry of selections: its
    recorded plan's event (dptrain.train.ledger.verification.ledger_sampling, as the ledger's
    verifier charges it), or for a ledger without a plan the registered name in its
    mechanism.sampling (Poisson when absent). None when the charge is not one selection's with
    independent noise (correlated noise, cyclic groups: an `accounting` record) or names no
    registered selection: such a job is not composed."""
    from dptrain.train.ledger.verification import ledger_sampling

    if data.get("accounting") is not None:
        return None
    if data.get("plan"):
        try:
            event = ledger_sampling(data)
        except DPTrainError:   # a plan this version cannot rebuild: not composed, never guessed
            return None
        return event.traits if event.plain else None
    return _registered(str((data.get("mechanism") or {}).get("sampling", UNRECORDED_SAMPLING)))


def _registered(name: str) -> SelectionAccounting | None:
    """The registered accounting of the selection `name`, None for a name it does not know (a
    ledger's words for a qualified charge)."""
    try:
        return selection_accounting(name)
    except PrivacyError:
        return None


def _charged_as(data: dict[str, Any]) -> str:
    """How a job's steps were charged: its mechanism.sampling (poisson for a ledger written
    before it was recorded), qualified when its ledger records a charge other than plain DP-SGD
    (`accounting`: correlated noise, cyclic groups), whose history read as Poisson steps would
    under-count it."""
    sampling = (data.get("mechanism") or {}).get("sampling", UNRECORDED_SAMPLING)
    if data.get("accounting") is not None:
        relation = data["accounting"].get("relation", "?")
        return f"{sampling} with correlated noise or sampling groups ({relation})"
    return sampling


def _unit_of(data: dict[str, Any]) -> str:
    """Who a job's epsilon protects: its plan's unit ("example" | "user"); a ledger written
    before the plan was recorded names a user-level unit in mechanism.privacy_unit."""
    unit = ((data.get("plan") or {}).get("unit") or {}).get("kind")
    if unit is not None:
        return str(unit)
    return unit_described(str((data.get("mechanism") or {}).get("privacy_unit", "")))


def _mixed_units(entries: list[dict[str, Any]]) -> str | None:
    """Why the jobs' costs cannot be composed into one epsilon (None when they can): some jobs
    protect one user (privacy.unit=user) and others one example. Under the coarser unit, the
    user, an example-level job is (k eps, k e^((k-1) eps) delta)-DP by group privacy over the k
    examples of the largest user, and no ledger records k (a user-level job's
    max_examples_per_user caps a user's examples in one batch, not in the data). Under the finer
    unit, the example, a user-level job's add/remove-a-user guarantee covers adding or removing
    one example only as replacing that example's user (group privacy over 2), which is not what
    its ledger states either. Each job's own ledger states its epsilon for its own unit."""
    jobs: dict[str, list[str]] = {}
    for entry in entries:
        if entry.get("private"):
            jobs.setdefault(entry.get("unit", Unit.kind), []).append(str(entry["job"]))
    if len(jobs) < 2:
        return None
    protected = " and ".join(
        f"job(s) {', '.join(names)} protect {unit_class(kind).protects} (privacy.unit={kind})"
        for kind, names in sorted(jobs.items(), key=lambda item: item[0] == Unit.kind))
    return (f"unknown: {protected}; a bound across units needs group privacy for the "
            "example-level jobs over the most examples one user holds, which no ledger "
            "records. Each job's own ledger states its epsilon for its unit; sweep one unit at "
            "a time to get the cost of the best job")


def sweep_unit(entries: list[dict[str, Any]]) -> str | None:
    """The unit the sweep's epsilon protects: the private jobs' one unit, "mixed", or None
    when no job is private."""
    units = {e.get("unit", Unit.kind) for e in entries if e.get("private")}
    return None if not units else units.pop() if len(units) == 1 else "mixed"


def read_tuning(sweep_dir: Path) -> dict[str, Any] | None:
    """The `tuning.json` of a sweep run by `dptrain tune` (None for a plain `dptrain -m`)."""
    path = Path(sweep_dir) / TUNING_FILENAME
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _common(entries: list[dict[str, Any]], key: str) -> set[Any]:
    return {e[key] for e in entries if e.get("private")}


def _not_composed(entries: list[dict[str, Any]],
                  charges: list[SelectionAccounting | None]) -> str | None:
    """Why the jobs' histories cannot be composed (None when they can): a job whose selection
    does not compose (its entry's `not_composed`: shuffled batches), or whose steps are charged
    as one correlated-noise event (correlated noise, cyclic groups), read as Poisson or random
    allocation steps would be under-counted."""
    why: dict[str, list[str]] = {}
    for entry, charge in zip(entries, charges):
        if not entry.get("private") or (charge is not None and charge.composes):
            continue
        reason = (charge.not_composed if charge is not None else
                  "its ledger records a charge with no per-run curve to compose (correlated "
                  "noise or cyclic sampling groups: one event over the whole run)")
        why.setdefault(reason, []).append(entry["job"])
    if not why:
        return None
    return ("unknown: " + "; ".join(f"job(s) {', '.join(jobs)}: {reason}"
                                    for reason, jobs in why.items())
            + f". The sweep composes jobs charged as {' or '.join(composable_selections())} "
            "only (each job's own ledger states its epsilon)")


def _all_composed(entries: list[dict[str, Any]], histories: list[History | None],
                  charges: list[SelectionAccounting | None], delta: float | None,
                  accountant: str) -> dict[str, Any]:
    cost: dict[str, Any] = {"epsilon": None, "accountant": accountant, "delta": delta,
                            "note": ALL_COMPOSED_NOTE}
    broken = [e["job"] for e in entries if "error" in e]
    public = [e["job"] for e, h in zip(entries, histories) if h is None and "error" not in e]
    if broken:
        cost["reason"] = (f"unknown: the ledger of job(s) {', '.join(broken)} cannot be read or "
                          "is missing")
    elif (unaccounted := _not_composed(entries, charges) or _mixed_units(entries)) is not None:
        cost["reason"] = unaccounted
    elif public:
        cost["epsilon"] = math.inf
        cost["reason"] = (f"job(s) {', '.join(public)} trained without privacy (privacy=none) on "
                          "the same data: releasing a job chosen among them has no guarantee")
    elif delta is None:
        cost["epsilon"] = 0.0
    elif all(c.pooled for c in charges if c is not None):   # Poisson only: one history
        cost["epsilon"] = composed_epsilon([h for h in histories if h], delta, accountant)
    else:
        runs = [(h, c) for h, c in zip(histories, charges) if h and c is not None]
        cost.update(accountant=TUNING_ACCOUNTANT, composition=RDP_COMPOSITION,
                    epsilon=composed_rdp_epsilon([h for h, _ in runs], [c for _, c in runs],
                                                 delta))
    return cost


def _agree(a: History, b: History) -> bool:
    """Whether two histories agree on their common first steps (floats to 1e-9 relative)."""
    steps = min(history_steps(a), history_steps(b))
    cut_a, cut_b = truncate_history(merge_history(a), steps), truncate_history(merge_history(b), steps)
    return len(cut_a) == len(cut_b) and all(
        n == m and math.isclose(s, t, rel_tol=1e-9) and math.isclose(q, r, rel_tol=1e-9)
        for (s, q, n), (t, r, m) in zip(cut_a, cut_b))


Bounded = list[tuple[History, SelectionAccounting]]   # histories and how each is charged


def _grid_bound(tuning: dict[str, Any], trials: Bounded) -> tuple[Bounded, str | None]:
    """(the histories every trial is bounded by, each with its charge, or why the bound does
    not hold): the planned history of every grid point of `tuning` (`grid_costs`, written by
    `dptrain tune` before the draw: a trial could have been any of them; charged as its
    recorded `sampling`, a selection's name) and the `trials` that ran.

    The reason names a grid point trained without privacy (the bound is then infinite: the
    caller states inf), one whose charge does not compose (shuffled batches, correlated noise:
    SelectionAccounting.rdp), or a trial whose history disagrees with its grid point's plan (the
    plans of the points not drawn are then not to be trusted).
    """
    grid = tuning["grid_costs"]
    public = [" ".join(g["overrides"]) or "(no grid)" for g in grid if g.get("history") is None]
    if public:
        return [], (f"infinite: grid point(s) {'; '.join(public)} train without privacy, and "
                    "any trial could have been one of them")
    charges = [_registered(str(g.get("sampling", UNRECORDED_SAMPLING))) for g in grid]
    other = [" ".join(g["overrides"]) for g, c in zip(grid, charges) if c is None or not c.composes]
    if other:
        return [], (f"unknown: grid point(s) {'; '.join(other)} are not charged as "
                    f"{' or '.join(composable_selections())} DP-SGD, and the random-stopping "
                    "bound is computed from their RDP curves only")
    planned = {json.dumps(g["overrides"]): (history_from_json(g["history"]), c)
               for g, c in zip(grid, charges)}
    for job, (history, _) in zip(tuning["jobs"], trials):
        plan = planned.get(json.dumps(job["overrides"]))
        if plan is None or not _agree(history, plan[0]):
            return [], (f"does not hold: trial {job['job']} spent a history that is not the "
                        "planned cost of its grid point in tuning.json, so the planned costs of "
                        "the grid points not drawn cannot be trusted either")
    return list(planned.values()) + trials, None


def _bound_epsilon(bounded_by: Bounded, trials: Trials, delta: float) -> float:
    """The random-stopping epsilon of trials each bounded by the worst curve of `bounded_by`
    (a job without a ledger, charge None, took no step: its curve is 0 and is left out)."""
    kept = [(h, c) for h, c in bounded_by if c is not None]
    return repeat_and_select_epsilon([h for h, _ in kept], trials, delta,
                                     charged_as=[c for _, c in kept])


def _random_stopping(tuning: dict[str, Any], entries: list[dict[str, Any]],
                     histories: list[History | None], charges: list[SelectionAccounting | None],
                     delta: float | None) -> dict[str, Any]:
    trials = Trials.from_json(tuning["trials"])
    drawn = [str(job["job"]) for job in tuning["jobs"]]
    cost: dict[str, Any] = {"epsilon": None, "accountant": TUNING_ACCOUNTANT, "delta": delta,
                            **trials.to_json(), "note": RANDOM_STOPPING_NOTE}
    ran = [e["job"] for e in entries]
    if sorted(ran) != sorted(drawn):
        cost["reason"] = (f"does not hold: tuning.json drew {len(drawn)} trial(s) "
                          f"({', '.join(drawn) or 'none'}) but the sweep folder holds job(s) "
                          f"{', '.join(ran) or 'none'}; it holds once exactly the drawn trials "
                          "have run")
    elif any(h is None for h in histories):
        cost["reason"] = "does not hold: a job is not private or its ledger cannot be read"
    elif (unaccounted := _not_composed(entries, charges) or _mixed_units(entries)) is not None:
        cost["reason"] = unaccounted
    elif delta is None or not histories:
        cost["epsilon"] = 0.0
    elif "grid_costs" in tuning:   # every grid point's planned cost: the bound holds as stated
        ran = _in_draw_order(tuning, entries, list(zip(histories, charges)))
        bounded_by, why_not = _grid_bound(tuning, ran)
        if why_not is None:
            cost["epsilon"] = _bound_epsilon(bounded_by, trials, delta)
            cost["per_trial"] = GRID_NOTE
        else:
            cost["epsilon"] = math.inf if why_not.startswith("infinite") else None
            cost["reason"] = why_not
    else:   # a tuning.json written before the grid's costs were recorded: its old rule
        cost["epsilon"] = _bound_epsilon(list(zip(histories, charges)), trials, delta)
        cost["caveat"] = ("tuning.json does not record the planned cost of every grid point "
                          "(written before dptrain recorded them): the per-trial bound is the "
                          "worst job that ran, and it holds only if no grid point that was not "
                          "drawn costs more")
    return cost


def _in_draw_order(tuning: dict[str, Any], entries: list[dict[str, Any]],
                   charged: Bounded) -> Bounded:
    """The trials' (history, charge) in tuning.json's order (the jobs ran as 0, 1, ...)."""
    by_job = {e["job"]: h for e, h in zip(entries, charged)}
    return [by_job[str(job["job"])] for job in tuning["jobs"]]


def sweep_cost(sweep_dir: Path | str) -> dict[str, Any]:
    """The sweep ledger of the sweep in `sweep_dir`, computed from its jobs' privacy ledgers."""
    from dptrain.cli.sweep import job_dirs   # here: dptrain.cli.sweep imports this module

    sweep_dir = Path(sweep_dir)
    read = [_job_entry(sweep_dir, d) for d in job_dirs(sweep_dir)]
    entries, histories, charges = ([r[i] for r in read] for i in range(3))
    deltas = {d for d in _common(entries, "delta") if d is not None}
    delta = min(deltas) if deltas else None     # the strictest delta of the jobs
    accountants = _common(entries, "accountant")
    # the jobs' accountant; RDP (an upper bound whatever the jobs used) when they differ
    accountant = accountants.pop() if len(accountants) == 1 else TUNING_ACCOUNTANT
    tuning = read_tuning(sweep_dir)
    selection = ({"rule": "all", "note": "every job of the sweep is a candidate"}
                 if tuning is None else {"rule": tuning["trials"]["distribution"],
                                         "trials_drawn": len(tuning["jobs"]), **tuning["trials"]})
    costs = {"all_composed": _all_composed(entries, histories, charges, delta, accountant)}
    if tuning is not None:
        costs["random_stopping"] = _random_stopping(tuning, entries, histories, charges, delta)
    holding = [c["epsilon"] for c in costs.values() if c["epsilon"] is not None]
    return {"schema_version": SWEEP_LEDGER_VERSION, "jobs": entries, "selection": selection,
            "privacy_unit": sweep_unit(entries), "delta": delta, "cost": costs,
            "epsilon": min(holding) if holding else None}


def write_sweep_ledger(sweep_dir: Path | str) -> dict[str, Any]:
    """Compute the sweep ledger and write it atomically to `sweep_dir/sweep_ledger.json`."""
    ledger = sweep_cost(sweep_dir)
    atomic_write_json(Path(sweep_dir) / SWEEP_LEDGER_FILENAME, ledger)
    return ledger


def describe_cost(ledger: dict[str, Any], jobs: int) -> str:
    """One sentence: what releasing the best of `jobs` jobs costs, from a sweep ledger (or the
    summary's `cost_of_best`): the table's caption, the plot's note (a line per "; " part).
    Each figure is stated once."""
    def eps(cost: dict[str, Any]) -> str:
        value = cost.get("epsilon")
        return "unknown" if value is None else f"epsilon {format_epsilon(value)}"

    composed = ledger["cost"]["all_composed"]
    at = f" at delta {ledger['delta']:g}" if ledger["delta"] is not None else ""
    all_jobs = f"{jobs} job{'s' if jobs != 1 else ''} composed ({composed['accountant']})"
    stopping = ledger["cost"].get("random_stopping")
    if stopping is None or ledger.get("epsilon") == composed.get("epsilon"):
        # the headline is the composed figure: said once, with where it comes from
        parts = [f"releasing the best job costs {eps(ledger)}{at}: the {all_jobs}"]
    else:
        parts = [f"releasing the best job costs {eps(ledger)}{at}", f"{all_jobs}: {eps(composed)}"]
    if stopping is not None:
        label = stopping["distribution"].replace("_", " ")
        parts.append(f"random stopping ({label}, mean {stopping['mean_trials']:.3g} trials, rdp): "
                     + (eps(stopping) if stopping["epsilon"] is not None else "does not hold"))
    return "; ".join(parts)


@dataclass
class SweepVerification:
    """Result of recomputing a sweep ledger from its jobs' ledgers."""

    path: Path
    claimed: float | None
    recomputed: float | None
    ok: bool
    message: str


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return float(a) == float(b) or math.isclose(float(a), float(b), rel_tol=RELATIVE_TOLERANCE)


def _stated_unknown_before(claimed: dict[str, Any], value: Any) -> bool:
    """Whether `value` is a version-1 sweep ledger's unknown (null) epsilon: version 1 composed
    Poisson-sampled jobs only (a balls-in-bins sweep was unknown), and an unknown claims nothing,
    so it is no mismatch where the jobs' ledgers now compose (`_outdated` says so)."""
    return value is None and claimed.get("schema_version", 1) < SWEEP_LEDGER_VERSION


def _outdated(claimed: dict[str, Any], recomputed: dict[str, Any]) -> str:
    """A note for a version-1 ledger that states unknown where the jobs now compose ("" else)."""
    if not _stated_unknown_before(claimed, claimed.get("epsilon")) or recomputed["epsilon"] is None:
        return ""
    return (f" (version {claimed.get('schema_version', 1)}: it states unknown where the jobs' "
            f"ledgers now give {format_epsilon(recomputed['epsilon'])}; rewrite it with "
            "`dptrain report` after deleting sweep_summary.json)")


def _differences(claimed: dict[str, Any], recomputed: dict[str, Any]) -> list[str]:
    found = []
    if [(j["job"], j.get("history_sha256")) for j in claimed.get("jobs", [])] != \
            [(j["job"], j.get("history_sha256")) for j in recomputed["jobs"]]:
        found.append("the jobs or their histories differ from the job folders' ledgers")
    if claimed.get("selection") != json.loads(json.dumps(recomputed["selection"])):
        found.append("the selection rule differs from tuning.json")
    for name, cost in recomputed["cost"].items():
        recorded = (claimed.get("cost") or {}).get(name) or {}
        if _stated_unknown_before(claimed, recorded.get("epsilon")):
            continue
        if not _same(recorded.get("epsilon"), _json_number(cost["epsilon"])):
            found.append(f"cost.{name}.epsilon claims {recorded.get('epsilon')!r}, the jobs' "
                         f"ledgers give {cost['epsilon']!r}")
    if not _same(claimed.get("epsilon"), _json_number(recomputed["epsilon"])) and \
            not _stated_unknown_before(claimed, claimed.get("epsilon")):
        found.append(f"epsilon claims {claimed.get('epsilon')!r}, the jobs' ledgers give "
                     f"{recomputed['epsilon']!r}")
    return found


def _json_number(value: Any) -> Any:
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def verify_sweep_ledger(sweep_dir: Path | str) -> SweepVerification:
    """Recompute the sweep ledger in `sweep_dir` from the jobs' ledgers and compare: ok when the
    jobs, their histories, the selection and every epsilon agree (relative tolerance 1e-6)."""
    path = Path(sweep_dir) / SWEEP_LEDGER_FILENAME
    try:
        claimed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return SweepVerification(path, None, None, False,
                                 f"unreadable ({error}); rewrite it with `dptrain report "
                                 f"{path.parent}` after deleting sweep_summary.json")
    recomputed = sweep_cost(path.parent)
    problems = _differences(claimed, recomputed)
    message = ("matches" + _outdated(claimed, recomputed) if not problems
               else "MISMATCH: " + "; ".join(problems))
    return SweepVerification(path, claimed.get("epsilon"), recomputed["epsilon"], not problems,
                             message)
