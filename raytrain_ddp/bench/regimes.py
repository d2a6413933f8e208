"""The three regimes of `raytrain bench overhead`, and the model and datasets they hand both arms.

compute   a step of 200 ms or more: resnet18 on 64 px images held in memory (CPU); with --gpu,
          resnet50 at 224 px in bf16, its inputs made on the GPU (see upsampled_resnet50)
input     JPEG decoding and augmentation in the loader's workers, feeding a small convnet
overhead  a step of a few milliseconds: a small MLP on 64-feature vectors, so what each framework
          adds per step shows

The datasets and models here are plugins (`--dataset raytrain_ddp.bench.regimes:tensors`), as a
user's would be: raytrain's workers import them, and the hand-written loop imports the same ones.
Sizes were picked on the 2-core CI machine (2 ranks of 1 CPU) for epochs of 10 s or more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

HERE = "raytrain_ddp.bench.regimes"
TENSORS = f"{HERE}:tensors"
FEATURES = 64
"""Inputs of the overhead regime's MLP."""
GPU_SIDE = 224
"""The side of the GPU compute regime's images, once made on the device."""


@dataclass(frozen=True)
class Regime:
    name: str
    what: str
    model: str
    dataset: str
    """`imagefolder` (a JPEG tree) or TENSORS (files that overhead.py writes, of `shape`)."""
    shape: tuple[int, ...]
    """One sample's input, as the model sees it: channels, then the image's sides (--image-size)."""
    batch_size: int
    train_samples: int
    val_samples: int
    loader_workers: bool
    """Whether --data-workers applies; otherwise the loader runs in the rank (the data is in memory)."""


REGIMES = {
    "compute": Regime("compute", "resnet18, 64 px images in memory", "resnet18", TENSORS, (3, 64, 64),
                      batch_size=32, train_samples=2048, val_samples=64, loader_workers=False),
    "input": Regime("input", "JPEG decode through ImageFolder, convnet at 32 px", "convnet", "imagefolder", (3, 32, 32),
                    batch_size=64, train_samples=14_336, val_samples=0, loader_workers=True),
    "overhead": Regime("overhead", f"an MLP on {FEATURES}-feature vectors", f"{HERE}:mlp", TENSORS, (FEATURES,),
                       batch_size=64, train_samples=491_520, val_samples=256, loader_workers=False),
}
GPU_COMPUTE = Regime("compute", f"resnet50, {GPU_SIDE} px, bf16, inputs made on the GPU", f"{HERE}:upsampled_resnet50",
                     TENSORS, (3, 8, 8), batch_size=128, train_samples=32_768, val_samples=256, loader_workers=False)
"""With --gpu: the loader moves 8x8 images (cheap), the model's first op scales them to 224 px on the GPU."""


def write_tensors(folder: Path, shape: tuple[int, ...], train: int, val: int, num_classes: int, seed: int = 0) -> Path:
    """folder/{train,val}.pt: random inputs of `shape` with random labels, for `tensors`."""
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("val", val)):
        torch.save({"inputs": torch.randn(n, *shape, generator=g), "labels": torch.randint(num_classes, (n,), generator=g)},
                   folder / f"{split}.pt")
    return folder


def tensors(split: str, data_dir: str, image_size: int) -> TensorDataset:
    """--dataset plugin: the split's tensors from write_tensors' folder (--data-dir)."""
    saved = torch.load(Path(data_dir) / f"{split}.pt")
    return TensorDataset(saved["inputs"], saved["labels"])


def mlp(num_classes: int, in_channels: int) -> nn.Module:
    """--model plugin: in_channels is the vectors' length."""
    return nn.Sequential(nn.Linear(in_channels, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, num_classes))


def upsampled_resnet50(num_classes: int, in_channels: int) -> nn.Module:
    """--model plugin: resnet50 whose input is first scaled to 224 px on its own device, so a loader
    of tiny images keeps the GPU fed as data already on the device would."""
    import torchvision

    return nn.Sequential(nn.Upsample(size=(GPU_SIDE, GPU_SIDE), mode="nearest"),
                         torchvision.models.resnet50(weights=None, num_classes=num_classes))
