"""The readers of each real format (formats.py), on small files the tests write."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_files import (
    PALETTE,
    WNIDS,
    cfg_for,
    write_cifar10,
    write_imagefolder,
    write_mnist,
    write_tinyimagenet,
)

from raytrain_ddp.config import ConfigError
from raytrain_ddp.data import formats
from raytrain_ddp.data.splits import split

# --- readers ---

@pytest.mark.parametrize("gz", [True, False])
def test_mnist_reads_idx_files(tmp_path, gz):
    layout = formats.read_mnist(write_mnist(tmp_path, gz=gz))
    assert (len(layout.train), len(layout.val), layout.channels, layout.image_size) == (200, 40, 1, 28)
    image, label = layout.train[3]
    assert image.shape == (1, 28, 28) and image.dtype == torch.uint8
    assert abs(float(image.float().mean()) - (30 + 65 * label)) < 10  # the pixels of the right sample


def test_mnist_truncated_idx_names_the_file(tmp_path):
    write_mnist(tmp_path, gz=False)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte is truncated"):
        formats.read_mnist(tmp_path)


def test_cifar10_reads_pickle_batches(tmp_path):
    layout = formats.read_cifar10(write_cifar10(tmp_path))
    assert (len(layout.train), len(layout.val), layout.classes[:2]) == (200, 40, ["airplane", "automobile"])
    image, label = layout.train[7]
    assert image.shape == (3, 32, 32)
    assert np.abs(image.float().mean(dim=(1, 2)).numpy() - PALETTE[label]).max() < 10  # channels in order


def test_tinyimagenet_reads_the_official_tree(tmp_path):
    layout = formats.read_tinyimagenet(write_tinyimagenet(tmp_path, per_class=3, val_per_class=2))
    assert layout.classes == WNIDS and (len(layout.train), len(layout.val)) == (12, 8)
    assert layout.val.paths[0].endswith("val_0.JPEG") and layout.val.labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.train[0][0].shape == (3, 64, 64)


def test_imagefolder_with_and_without_val(tmp_path):
    layout = formats.read_imagefolder(write_imagefolder(tmp_path / "a", per_class=3, val_per_class=2))
    assert (len(layout.train), len(layout.val), layout.classes) == (12, 8, [f"class_{i}" for i in range(4)])
    write_imagefolder(tmp_path / "b", per_class=10, val_per_class=None)
    train, val = split(cfg_for("imagefolder", tmp_path / "b", val_fraction=0.25), formats.read_imagefolder(tmp_path / "b"))
    assert (len(train), len(val)) == (30, 10)
    assert not set(train.paths) & set(val.paths)
    # Class folders straight under --data-dir work too.
    assert len(formats.read_imagefolder(tmp_path / "b" / "train").train) == 40
