"""PerPassStore: sum within a pass, concatenate across passes, zero rows for missed passes."""

import torch

from dptrain.grad_sample.accumulate import PerPassStore


def test_contributions_of_one_pass_are_summed() -> None:
    store = PerPassStore()
    store.add("w", 1, torch.ones(2, 3))
    store.add("w", 1, torch.full((2, 3), 2.0))
    store.add("w", 1, torch.full((2, 3), 4.0))
    assert torch.equal(store.materialize()["w"], torch.full((2, 3), 7.0))


def test_passes_are_concatenated_in_pass_id_order_whatever_the_arrival_order() -> None:
    store = PerPassStore()
    store.add("w", 7, torch.zeros(2, 1))
    store.add("w", 3, torch.ones(1, 1))
    assert torch.equal(store.materialize()["w"], torch.tensor([[1.0], [0.0], [0.0]]))
    assert store.batch_size() == 3


def test_a_key_missing_from_a_pass_gets_zero_rows_for_it() -> None:
    store = PerPassStore()
    store.add("a", 1, torch.ones(2, 2))
    store.add("b", 2, torch.ones(1, 2))
    full = store.materialize()
    assert torch.equal(full["a"], torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(full["b"], torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))


def test_added_values_are_never_modified() -> None:
    store = PerPassStore()
    first = torch.ones(2)
    store.add("w", 1, first)
    store.add("w", 1, torch.ones(2))
    store.add("w", 1, torch.ones(2))
    assert torch.equal(first, torch.ones(2))


def test_adding_to_a_materialized_pass_updates_it() -> None:
    store = PerPassStore()
    store.add("w", 1, torch.ones(2))
    store.materialize()
    store.add("w", 1, torch.ones(2))
    assert torch.equal(store.materialize()["w"], torch.full((2,), 2.0))


def test_discarding_the_last_key_forgets_the_passes() -> None:
    store = PerPassStore()
    store.add("w", 1, torch.ones(4))
    store.discard("w")
    assert store.batch_size() == 0 and not list(store.keys())
