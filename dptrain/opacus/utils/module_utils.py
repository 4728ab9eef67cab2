"""Opacus's ``opacus.utils.module_utils`` helpers that user code calls."""

from __future__ import annotations

from typing import Any, Mapping

import torch


def are_state_dict_equal(sd1: Mapping[str, Any], sd2: Mapping[str, Any]) -> bool:
    """True when both state dicts have the same keys and allclose tensors."""
    return len(sd1) == len(sd2) and all(
        k in sd2 and torch.allclose(v, sd2[k]) for k, v in sd1.items())


__all__ = ["are_state_dict_equal"]
