"""Opacus's ``opacus.lightning``: DPLightningDataModule, a PyTorch Lightning data module that
Poisson-samples another; dptrain has no Lightning integration (and does not import Lightning)."""

from dptrain.opacus._absent import absent

DPLightningDataModule = absent(
    "opacus.lightning.DPLightningDataModule",
    "dptrain.opacus.data_loader.DPDataLoader.from_data_loader(loader) in your data module's "
    "train_dataloader(), with the optimizer made private by PrivacyEngine.make_private (or "
    "dptrain's own runner, `dptrain train`, or its Hugging Face Trainer integration)")

__all__ = ["DPLightningDataModule"]
