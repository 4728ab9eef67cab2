"""Bridges from other training frameworks to dptrain's private step.

Each module is imported only by the user who needs it (nothing here is imported by `dptrain`
itself, and the engine never imports this package):

    hf_trainer   PrivateTrainer / PrivacyArguments: a Hugging Face `transformers.Trainer` script
                 made private with a few lines (docs/hf-trainer.md)
"""
