"""BatchMemoryManager: logical batches as physical chunks, skipping all but the last step."""

from __future__ import annotations

import pytest
import torch

from dptrain.data.virtual import BatchMemoryManager, split_batch
from dptrain.errors import ConfigError


class RecordingOptimizer:
    """Records the skip signal in force at each step()."""

    def __init__(self) -> None:
        self.skip = False
        self.steps: list[bool] = []

    def signal_skip_step(self, do_skip: bool = True) -> None:
        self.skip = do_skip

    def step(self) -> None:
        self.steps.append(self.skip)
        self.skip = False


def _run(batches, max_size):
    opt = RecordingOptimizer()
    chunks = []
    with BatchMemoryManager(data_loader=batches, max_physical_batch_size=max_size,
                            optimizer=opt) as loader:
        for chunk in loader:
            chunks.append(chunk)
            opt.step()
    return chunks, opt


def test_chunks_are_at_most_the_physical_size_and_cover_the_logical_batch():
    x = torch.arange(10.0)
    chunks, _ = _run([(x, x * 2)], 4)
    assert [c[0].shape[0] for c in chunks] == [4, 4, 2]
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    assert torch.equal(torch.cat([c[1] for c in chunks]), x * 2)


def test_only_the_last_chunk_of_each_logical_batch_steps():
    _, opt = _run([torch.zeros(5, 1), torch.zeros(2, 1)], 2)
    assert opt.steps == [True, True, False, False]


def test_an_empty_logical_batch_is_one_empty_chunk_that_steps():
    chunks, opt = _run([torch.zeros(0, 3)], 2)
    assert len(chunks) == 1 and chunks[0].shape == (0, 3)
    assert opt.steps == [False]


def test_dict_batches_are_split_key_by_key():
    chunks = split_batch({"x": torch.zeros(5, 2), "y": torch.ones(5)}, 3)
    assert [c["x"].shape[0] for c in chunks] == [3, 2]
    assert [c["y"].shape[0] for c in chunks] == [3, 2]


def test_leaving_the_context_clears_a_pending_skip():
    opt = RecordingOptimizer()
    with BatchMemoryManager(data_loader=[torch.zeros(4, 1)], max_physical_batch_size=1,
                            optimizer=opt) as loader:
        next(iter(loader))
    assert opt.skip is False


def test_a_non_positive_physical_size_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=[], max_physical_batch_size=0, optimizer=RecordingOptimizer())


def test_an_optimizer_that_cannot_skip_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer"):
        BatchMemoryManager(data_loader=[], max_physical_batch_size=2, optimizer=object())
