"""A --dataset and a --model for the exactness tests.

build: small learnable images under the user's own random flip and shift (drawn from torch's global
stream, as most user transforms do), that logs, for every training sample read, the seed its draws
came from: torch_ingest.sample_seed(seed, epoch, index) names the sample and its epoch exactly, so a
test can tell that each was trained once per epoch. Called as build(split=, data_dir=, image_size=);
the log goes to DATA_DIR/<pid>.log.

net: a small CNN with BatchNorm and dropout. Dropout draws from each rank's own torch stream, so a
resume is exact only if checkpoints save and restore it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

TRAIN, VAL, SIDE, CLASSES = 128, 40, 16, 4


class Logged(Dataset):
    def __init__(self, split: str, log_dir: str, size: int):
        self.split, self.log_dir, self.size = split, log_dir, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % CLASSES
        g = torch.Generator().manual_seed(index + (0 if self.split == "train" else 10**6))
        image = torch.randn(3, SIDE, SIDE, generator=g) + label
        if self.split == "train":
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
            dx, dy = torch.randint(0, 5, (2,)).tolist()
            image = F.pad(image, (2, 2, 2, 2))[:, dy : dy + SIDE, dx : dx + SIDE]
            with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as log:
                log.write(f"{torch.initial_seed()}\n")
        return image, label


def build(split: str, data_dir: str, image_size: int) -> Logged:
    return Logged(split, data_dir, TRAIN if split == "train" else VAL)


def net(num_classes: int, in_channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(16 * (SIDE // 2) ** 2, num_classes),
    )
