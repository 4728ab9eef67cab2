"""A private run without Hydra: the loop, the ledger, checkpoints, resume, the budget guard.

From plain Python, a run gets the same ledger, checkpoints, resume and budget guard as the
`dptrain` command::

    engine = dptrain.PrivacyEngine(seed=0)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    job = dptrain.train.private_job(engine, model, optimizer, loader, target_epsilon=3.0)
    result = dptrain.train.train(job, dptrain.train.TrainSettings(run_dir="run", epochs=3,
                                                                  batch_size=64))

Modules: job.py (TrainingJob, private_job, RunResult), settings.py (TrainSettings, the sizing
rule), lr_schedule.py (learning-rate schedules), loop.py
(train, Trainer), budget.py (BudgetGuard, PrivacySpend), ledger/ (PrivacyLedger,
verify_ledger: schema, hashing, verification, record), ledger_check.py (the run's records against the ledger's history), checkpoint.py
(Checkpointer, load_checkpoint), resume.py (Resumer), replay.py (what a resume may drop),
run_lock.py (one process per run folder), evaluation.py (evaluate, Evaluator), display.py
(progress, summary), loggers.py (metric loggers: metrics.jsonl, TensorBoard, CSV, W&B, MLflow).
Public names are imported lazily (importing this package loads no torch).
"""

from dptrain._lazy import lazy_attributes

_PUBLIC = {
    "train": "dptrain.train.loop",
    "Trainer": "dptrain.train.loop",
    "TrainingJob": "dptrain.train.job",
    "PrivacySettings": "dptrain.train.job",
    "RunResult": "dptrain.train.job",
    "RunInterrupted": "dptrain.train.job",
    "RunPreempted": "dptrain.train.job",
    "private_job": "dptrain.train.job",
    "TrainConfig": "dptrain.train.settings",
    "TrainSettings": "dptrain.train.settings",
    "LRSchedule": "dptrain.train.lr_schedule",
    "BudgetGuard": "dptrain.train.budget",
    "PrivacyLedger": "dptrain.train.ledger",
    "load_ledger": "dptrain.train.ledger",
    "verify_ledger": "dptrain.train.ledger",
    "load_checkpoint": "dptrain.train.checkpoint",
    "evaluate": "dptrain.train.evaluation",
    "MetricLogger": "dptrain.train.loggers",
    "JsonlLogger": "dptrain.train.loggers",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_attributes(__name__, _PUBLIC)
