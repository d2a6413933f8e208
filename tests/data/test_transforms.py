"""Normalisation and augmentation per format."""

from __future__ import annotations

import pytest
import torch
from sample_files import (
    CLASSES,
    cfg_for,
    write_cifar10,
    write_imagefolder,
    write_mnist,
    write_tinyimagenet,
)

from raytrain_ddp.data.registry import DATASETS
from raytrain_ddp.data.transforms import RECIPES, augmentation

# --- transforms ---

@pytest.mark.parametrize(
    "dataset, writer, channels", [("mnist", write_mnist, 1), ("cifar10", write_cifar10, 3),
                                  ("tinyimagenet", write_tinyimagenet, 3), ("imagefolder", write_imagefolder, 3)]
)
def test_transforms_give_normalised_images_of_image_size(tmp_path, dataset, writer, channels):
    writer(tmp_path)
    built = DATASETS[dataset](cfg_for(dataset, tmp_path, image_size=20))
    assert built.in_channels == channels
    for split in (built.train, built.val):
        image, label = split[0]
        assert image.shape == (channels, 20, 20) and image.dtype == torch.float32 and 0 <= label < CLASSES
    batch = torch.stack([built.val[i][0] for i in range(len(built.val))])
    assert abs(float(batch.mean())) < 3 and float(batch.std()) > 0.1  # normalised, not raw 0..255


def test_training_augmentation_is_random_and_val_is_not():
    image = torch.arange(3 * 32 * 32, dtype=torch.float32).reshape(3, 32, 32).to(torch.uint8)
    train = augmentation(True, 32, 32, flip=True)
    assert any(not torch.equal(train(image), train(image)) for _ in range(10))
    val = augmentation(False, 32, 32, flip=True)
    assert torch.equal(val(image), image)
    assert augmentation(False, 16, None, flip=True)(image).shape == (3, 16, 16)


def test_mnist_is_never_flipped():
    assert not RECIPES["mnist"].flip and RECIPES["cifar10"].flip
