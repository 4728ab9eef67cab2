"""dptrain: differentially private training of PyTorch models.

Two lines from plain Python::

    engine = dptrain.PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)

A ledger-keeping, resumable run of your own model, optimizer and loader: ``dptrain.train``
(``dptrain.train.private_job`` and ``dptrain.train.train``).

Public names are imported lazily so that ``import dptrain`` (and ``dptrain --help``) stays fast.
"""

from dptrain._lazy import lazy_attributes

__version__ = "0.5.0"

_PUBLIC = {
    "PrivacyEngine": "dptrain.privacy.engine",
    "make_private": "dptrain.privacy.engine",
    "GradSampleModule": "dptrain.grad_sample.module",
    "register_grad_sampler": "dptrain.grad_sample.registry",
    "register_norm_sampler": "dptrain.grad_sample.registry",
    "ModuleValidator": "dptrain.validation",
    "check_per_sample_gradients": "dptrain.grad_sample.check",
    "BatchMemoryManager": "dptrain.data.virtual",
    "DPTrainError": "dptrain.errors",
    "token_loss": "dptrain.losses",
    "TokenLoss": "dptrain.losses",
    # a private run without the command line (dptrain.train)
    "TrainingJob": "dptrain.train.job",
    "TrainSettings": "dptrain.train.settings",
    "RunResult": "dptrain.train.job",
    "private_job": "dptrain.train.job",
    "PrivacyLedger": "dptrain.train.ledger",
    "verify_ledger": "dptrain.train.ledger",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


__getattr__ = lazy_attributes(__name__, _PUBLIC)
