"""The one warning every Opacus call that dptrain runs differently gives."""

import warnings


def changed(what: str) -> None:
    """Warn (UserWarning) that an Opacus-shaped call runs differently under dptrain: `what`
    says what changed and the one-line change that avoids it."""
    warnings.warn(f"dptrain.opacus: {what}", UserWarning, stacklevel=3)
