"""Dataset registry: a plain dict from name to a builder taking the TrainConfig.

Every rank calls the same builder with the same config, so every rank holds the same dataset and the
DistributedSampler in the loop decides which rank sees which sample.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from raytrain_ddp.config import ConfigError, TrainConfig


class Data(NamedTuple):
    train: Dataset
    val: Dataset
    in_channels: int


class SyntheticImages(Dataset):
    """Smooth per-class prototype images plus per-sample noise: learnable, generated from the seed.

    Samples are made on demand from (seed, split, index), so nothing is held in memory and every rank
    and every DataLoader worker produces the same sample for the same index.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, split: int):
        self.size, self.seed, self.split = size, seed, split
        g = torch.Generator().manual_seed(seed)
        low_res = torch.randn(num_classes, 3, 4, 4, generator=g)
        self.prototypes = F.interpolate(low_res, size=image_size, mode="bilinear", align_corners=False)
        self.prototypes /= self.prototypes.std(dim=(1, 2, 3), keepdim=True)
        g.manual_seed(seed * 7919 + split)
        self.labels = torch.randint(num_classes, (size,), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(((self.seed * 7919 + self.split) << 32) + index)
        label = int(self.labels[index])
        noise = torch.randn(self.prototypes.shape[1:], generator=g)
        # Noise at 2x the signal keeps the first epoch well short of 100%, so "it learned" shows.
        return self.prototypes[label] + 2.0 * noise, label


def synthetic(cfg: TrainConfig) -> Data:
    if cfg.train_samples < 1 or cfg.val_samples < 1:
        raise ConfigError("--dataset synthetic needs --train-samples and --val-samples of at least 1")
    make = lambda size, split: SyntheticImages(size, cfg.num_classes, cfg.image_size, cfg.seed, split)
    return Data(make(cfg.train_samples, 0), make(cfg.val_samples, 1), in_channels=3)


DATASETS: dict[str, Callable[[TrainConfig], Data]] = {
    "synthetic": synthetic,
}
