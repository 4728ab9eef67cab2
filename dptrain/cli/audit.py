"""`dptrain audit ...` (alias `dptrain +audit=one_run ...`): train once with canaries, then audit.

The run is the one the same command without the audit would train, plus m canaries
(`dptrain.audit`): white-box Dirac gradient canaries inserted into the clipped sum, or
black-box mislabeled training examples. After training, the canaries are scored, the empirical
lower bound on epsilon is computed and compared with the run's claimed epsilon (the ledger's, at
its delta); `audit.json` and `audit_scores.png` are written beside the ledger, and the ledger
records the audit under "audit".

Config keys (group `audit`, conf/audit/one_run.yaml): kind, canaries, confidence, score,
guesses, guess_sides, seed, norm_multiplier. Refused before training, naming the key: a
non-private run (privacy=none claims no finite epsilon), more canaries than the model's
coordinates (white box) or the training examples (black box) allow, a confidence outside
(0, 1), resuming from a checkpoint made without canaries, and several ranks (hardware=ddp or fsdp).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUBCOMMAND = "audit"
DEFAULT_OPTION = "+audit=one_run"
KINDS = ("white_box", "black_box")
_KEYS = ("name", "kind", "canaries", "confidence", "score", "guesses", "guess_sides", "seed",
         "norm_multiplier")


def expand_subcommand(argv: list[str]) -> None:
    """`dptrain audit ARGS` -> `dptrain +audit=one_run ARGS` (in place; unless an audit option
    is already chosen with +audit=NAME)."""
    if len(argv) < 2 or argv[1] != SUBCOMMAND:
        return
    chosen = any(arg.startswith(("+audit=", "audit=")) for arg in argv[2:])
    argv[1:2] = [] if chosen else [DEFAULT_OPTION]


@dataclass(frozen=True)
class AuditSettings:
    """The checked `audit` config section."""

    kind: str
    canaries: int
    confidence: float
    score: str
    rules: Any            # dptrain.audit.GuessingRules
    seed: int
    norm_multiplier: float


def audit_settings(section: dict[str, Any], privacy: dict[str, Any]) -> AuditSettings:
    """The `audit` section checked (ConfigError naming the key); privacy=none is refused."""
    from dptrain.audit.bound import check_confidence
    from dptrain.audit.canaries import WHITE_BOX_SCORES
    from dptrain.audit.result import GuessingRules
    from dptrain.cli.build import privacy_mode, reject_unknown_keys
    from dptrain.errors import ConfigError

    reject_unknown_keys(section, "audit", _KEYS)
    if privacy_mode(privacy) == "none":
        raise ConfigError("audit: privacy=none trains without a privacy guarantee, so its "
                          "epsilon bound is infinite and there is nothing to audit; audit a "
                          "private run (privacy=epsilon or privacy=sigma), or drop the audit.")
    kind = section.get("kind", "white_box")
    if kind not in KINDS:
        raise ConfigError(f"audit.kind={kind!r} is not an audit kind; use one of {list(KINDS)}.")
    score = section.get("score", "all_iterates")
    if kind == "black_box":
        score = "loss"  # a black-box canary is scored by the final model's loss on it
    elif score not in WHITE_BOX_SCORES:
        raise ConfigError(f"audit.score={score!r}: a white-box audit scores "
                          f"{list(WHITE_BOX_SCORES)}.")
    canaries = section.get("canaries")
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 1:
        raise ConfigError(f"audit.canaries={canaries!r} must be a positive number of canaries "
                          "(m, e.g. 1000).")
    norm = section.get("norm_multiplier", 10.0)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm < 1:
        raise ConfigError(f"audit.norm_multiplier={norm!r} must be >= 1 (the canary gradient's "
                          "norm before clipping, in units of privacy.max_grad_norm).")
    seed = section.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"audit.seed={seed!r} must be an integer.")
    rules = GuessingRules(tuple(section.get("guesses") or ()),
                          tuple(section.get("guess_sides") or ()))
    return AuditSettings(kind=kind, canaries=canaries,
                         confidence=check_confidence(section.get("confidence"),
                                                     "audit.confidence"),
                         score=score, rules=rules, seed=seed, norm_multiplier=float(norm))


class _AuditedEngine:
    """The run's PrivacyEngine, whose checkpointed state also carries the canaries' state."""

    def __init__(self, engine: Any, canaries: Any) -> None:
        self._engine, self._canaries = engine, canaries

    def state_dict(self) -> dict[str, Any]:
        return {**self._engine.state_dict(), "audit": self._canaries.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from dptrain.errors import ConfigError

        state = dict(state)
        audit = state.pop("audit", None)
        if audit is None:
            raise ConfigError("train.resume: the checkpoint was made without canaries, so the "
                              "audit (audit.*) could not cover the steps before it; start a new "
                              "audited run in a new folder, or resume without the audit.")
        self._engine.load_state_dict(state)
        self._canaries.load_state_dict(audit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _refuse_resume_without_canaries(settings: Any, run_dir: Path) -> None:
    """ConfigError when train.resume names a checkpoint whose config had no audit."""
    from dptrain.train import checkpoint as ckpt
    from dptrain.errors import ConfigError

    path = ckpt.resolve_resume(settings.resume, run_dir)
    if path is None or not Path(path).is_file():
        return
    if not ckpt.load_checkpoint(path)["config"].get("audit"):
        raise ConfigError(f"train.resume={str(path)!r} is a checkpoint made without canaries "
                          "(its config has no audit.*): an audit inserts its canaries from the "
                          "first step. Start a new audited run in a new folder, or resume "
                          "without the audit.")


def audited_run(cfg: Any, run_dir: Path, loggers: Any = None) -> Any:
    """Build the job with canaries, train it (with `loggers`, the trainer's metric loggers),
    audit it; returns the trainer's RunResult."""
    from dptrain.audit.canaries import DiracCanaries, MislabeledCanaries, check_canary_count
    from dptrain.cli.build import build_job, resolve_config
    from dptrain.train.loop import train
    from dptrain.distributed.runtime import get_world_size
    from dptrain.errors import ConfigError

    resolved = resolve_config(cfg)
    audit = audit_settings(resolved.get("audit") or {}, resolved.get("privacy") or {})
    if get_world_size() > 1:
        raise ConfigError("audit runs in one process: its canaries would be inserted once per "
                          "rank under hardware=ddp or hardware=fsdp. Audit with hardware=cpu or "
                          "hardware=cuda.")
    black_box: list[Any] = []

    def insert_examples(splits: Any) -> Any:
        check_canary_count(audit.canaries, len(splits.train), "the training set",
                           "audit.canaries")
        canaries = MislabeledCanaries(splits.train, audit.canaries,
                                      num_classes=splits.num_classes, seed=audit.seed)
        black_box.append(canaries)
        return _with_train(splits, canaries.training_set())

    job, settings = build_job(cfg, run_dir, prepare_splits=insert_examples
                              if audit.kind == "black_box" else None)
    _refuse_resume_without_canaries(settings, Path(settings.run_dir))
    if audit.kind == "white_box":
        limit = sum(p.numel() for p in job.optimizer.params)
        check_canary_count(audit.canaries, limit, "the model's trainable coordinates",
                           "audit.canaries")
        canaries: Any = DiracCanaries(job.optimizer, audit.canaries, seed=audit.seed,
                                      norm_multiplier=audit.norm_multiplier)
    else:
        canaries = black_box[0]
    job.engine = _AuditedEngine(job.engine, canaries)
    result = train(job, settings, loggers)
    _conclude(audit, canaries, job, result)
    return result


def _with_train(splits: Any, train: Any) -> Any:
    from dataclasses import replace

    return replace(splits, train=train, info=dict(splits.info))


def _conclude(audit: AuditSettings, canaries: Any, job: Any, result: Any) -> None:
    """Score the canaries, write audit.json + the figure, record the audit in the ledger."""
    from torch import nn

    from dptrain.audit.result import AUDIT_FILE, FIGURE_FILE, audit_scores
    from dptrain.train.ledger import LEDGER_FILENAME, PrivacyLedger, load_ledger
    from dptrain.distributed.runtime import is_main_process

    if audit.kind == "white_box":
        scores = canaries.scores(audit.score)
    else:
        scores = canaries.scores(job.model, lambda out, y: nn.functional.cross_entropy(
            out.float(), y, reduction="none"), device=job.device)
    found = audit_scores(scores, canaries.included.numpy(), kind=audit.kind, score=audit.score,
                         claimed_epsilon=result.epsilon, delta=result.delta,
                         confidence=audit.confidence, rules=audit.rules,
                         out_dir=result.run_dir)
    if is_main_process():
        ledger_path = Path(result.run_dir) / LEDGER_FILENAME
        ledger = PrivacyLedger(ledger_path, load_ledger(ledger_path))
        record = {key: value for key, value in found.to_dict().items() if key != "rules"}
        ledger.record_audit({**record, "file": AUDIT_FILE})
    print(found.summary(), file=sys.stdout, flush=True)
    if is_main_process():
        print(_written(Path(result.run_dir), AUDIT_FILE, FIGURE_FILE), file=sys.stdout,
              flush=True)


def _written(run_dir: Path, record: str, figure: str) -> str:
    """The line naming where the audit was written: the record, and the figure when drawn
    (it is not without matplotlib)."""
    line = f"Audit written to {run_dir / record}"
    if (run_dir / figure).is_file():
        line += f" and its score histogram to {run_dir / figure}"
    return line + "."
