"""CIFAR-10 read from python pickle batches written by the test in the real format."""

import pickle

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.errors import ConfigError

from tests.data.datasets.on_disk import CIFAR10_NAMES, write_cifar10


def test_cifar10_reads_the_five_training_batches_and_the_test_batch(tmp_path):
    batches = write_cifar10(tmp_path)
    splits = load_dataset("cifar10", root=tmp_path)
    assert len(splits.train) == 15 and len(splits.test) == 3
    expected = [label for i in range(1, 6) for label in batches[f"data_batch_{i}"][b"labels"]]
    assert splits.train.labels.tolist() == expected
    assert splits.num_classes == 10


def test_cifar10_rows_become_channel_major_3x32x32_images(tmp_path):
    batches = write_cifar10(tmp_path)
    splits = load_dataset("cifar10", root=tmp_path)
    row = batches["test_batch"][b"data"][2]
    assert torch.equal(splits.test.features[2], torch.from_numpy(row.reshape(3, 32, 32)))
    x, _ = splits.test[2]
    expected_red = (torch.from_numpy(row[:1024].reshape(32, 32)).float() / 255 - 0.4914) / 0.2470
    torch.testing.assert_close(x[0], expected_red)


def test_cifar10_class_names_come_from_batches_meta(tmp_path):
    write_cifar10(tmp_path)
    assert load_dataset("cifar10", root=tmp_path).info["classes"] == CIFAR10_NAMES


def test_cifar10_missing_offline_names_the_path_and_the_download_flag(tmp_path):
    with pytest.raises(ConfigError, match="dataset.download=true") as error:
        load_dataset("cifar10", root=tmp_path)
    assert "cifar-10-batches-py" in str(error.value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_batches_pickled_at_any_protocol_are_read(tmp_path, protocol):
    batches = write_cifar10(tmp_path, protocol=protocol)
    splits = load_dataset("cifar10", root=tmp_path)
    assert splits.test.labels.tolist() == batches["test_batch"][b"labels"]
    assert splits.info["classes"] == CIFAR10_NAMES


class _WritesMarker:
    """Unpickled, it creates the file `marker` (what a crafted batch could do with any code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_cifar10_batch_that_would_run_code_is_refused_naming_the_file(tmp_path):
    write_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    marker = tmp_path / "code_ran"
    batch.write_bytes(pickle.dumps({b"data": _WritesMarker(marker), b"labels": [0]}))
    with pytest.raises(ConfigError, match="it names io.open") as refused:
        load_dataset("cifar10", root=tmp_path)
    assert not marker.exists()
    assert str(batch) in str(refused.value) and "dataset.download=true" in str(refused.value)
