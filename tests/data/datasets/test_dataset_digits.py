"""The embedded digits dataset: fixed stratified split, [0, 1] scaling, synthetic look-alikes."""

import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.digits import read_digits_csv, stratified_test_mask


def test_digits_splits_cover_every_image_once_with_80_20_per_class():
    _, labels = read_digits_csv()
    splits = load_dataset("digits")
    assert len(splits.train) + len(splits.test) == len(labels) == 1797
    for cls in range(10):
        n_cls = int((labels == cls).sum())
        assert int((splits.test.labels == cls).sum()) == n_cls // 5


def test_digits_test_mask_takes_every_fifth_example_of_each_class_in_file_order():
    labels = torch.tensor([0, 1, 0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0])
    mask = stratified_test_mask(labels, test_every=2)
    zeros = (labels == 0).nonzero().flatten()
    ones = (labels == 1).nonzero().flatten()
    assert mask[zeros].tolist() == [i % 2 == 1 for i in range(len(zeros))]
    assert mask[ones].tolist() == [i % 2 == 1 for i in range(len(ones))]


def test_digits_inputs_are_64_floats_scaled_to_unit_interval():
    splits = load_dataset("digits")
    x, y = splits.train[0]
    assert x.shape == (64,) and x.dtype == torch.float32
    everything = splits.train.transform(splits.train.features)
    assert everything.min() == 0.0 and everything.max() == 1.0
    assert y.dtype == torch.int64


def test_digits_split_is_the_same_on_every_load():
    first, second = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(first.test.features, second.test.features)


def test_digits_synthetic_has_the_real_split_sizes_and_classes():
    real = load_dataset("digits")
    fake = load_dataset("digits", synthetic=True, seed=3)
    assert (len(fake.train), len(fake.test)) == (len(real.train), len(real.test))
    assert fake.num_classes == 10 and fake.train[0][0].shape == (64,)
    assert not torch.equal(fake.train.features, real.train.features)
