"""MNIST read from IDX files written by the test in the real format (plain and gzip)."""

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.errors import ConfigError

from tests.data.datasets.on_disk import write_mnist


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reads_idx_files_in_torchvisions_layout(tmp_path, compress):
    arrays = write_mnist(tmp_path / "MNIST" / "raw", compress=compress)
    splits = load_dataset("mnist", root=tmp_path)
    images, labels = arrays["train"]
    assert len(splits.train) == 6 and len(splits.test) == 4
    assert torch.equal(splits.train.features[:, 0], torch.from_numpy(images))
    assert splits.train.labels.tolist() == labels.tolist()


def test_mnist_inputs_are_normalized_1x28x28_floats(tmp_path):
    arrays = write_mnist(tmp_path)
    splits = load_dataset("mnist", root=tmp_path)
    x, _ = splits.test[1]
    expected = (torch.from_numpy(arrays["test"][0][1]).float() / 255 - 0.1307) / 0.3081
    assert x.shape == (1, 28, 28)
    torch.testing.assert_close(x[0], expected)


def test_mnist_missing_offline_names_the_path_and_the_download_flag(tmp_path):
    with pytest.raises(ConfigError, match="dataset.download=true") as error:
        load_dataset("mnist", root=tmp_path)
    assert "train-images-idx3-ubyte" in str(error.value)


def test_mnist_truncated_file_is_reported(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ConfigError, match="truncated"):
        load_dataset("mnist", root=tmp_path)


def test_mnist_failed_download_names_the_root_and_the_offline_alternatives(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    with pytest.raises(ConfigError, match="network unreachable") as error:
        load_dataset("mnist", root=tmp_path, download=True)
    assert f"dataset.root={tmp_path}" in str(error.value) and "dataset.synthetic=true" in str(
        error.value
    )
