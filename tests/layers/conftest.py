"""Helpers for the DP layer tests: torch/DP layer pairs with identical weights, in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence


def _load_pair(
    torch_cls: type, dp_cls: type, *args: Any, **kwargs: Any
) -> tuple[nn.Module, nn.Module]:
    """A torch layer and its DP counterpart in float64; the DP one loads the torch state_dict."""
    reference = torch_cls(*args, dtype=torch.float64, **kwargs)
    private = dp_cls(*args, dtype=torch.float64, **kwargs)
    private.load_state_dict(reference.state_dict())
    return reference, private


def _flatten(value: Any) -> list[torch.Tensor]:
    """Tensors of a (nested) output, PackedSequences by data and layout."""
    if value is None:
        return []
    if isinstance(value, PackedSequence):
        layout = [value.batch_sizes]
        layout += [t for t in (value.sorted_indices, value.unsorted_indices) if t is not None]
        return [value.data, *layout]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _flatten(item)]
    return [value]


def _assert_same(actual: Any, expected: Any) -> None:
    """Equal structure, shapes and values (float64 tolerance)."""
    actual_list, expected_list = _flatten(actual), _flatten(expected)
    assert len(actual_list) == len(expected_list)
    for a, e in zip(actual_list, expected_list):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.fixture
def load_pair() -> Callable[..., tuple[nn.Module, nn.Module]]:
    return _load_pair


@pytest.fixture
def assert_same() -> Callable[[Any, Any], None]:
    return _assert_same
