"""The dataset registry: --dataset name (or the user's import path) to a builder of train and val
Datasets, on the ranks.

The file formats themselves are read by formats.py, split and capped by splits.py (the driver's
checks in dataset_checks.py read them the same way); transforms.py wraps the samples for the model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from raytrain_ddp import plugins
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.dataset_checks import data_root
from raytrain_ddp.data.formats import READERS, Layout, Samples
from raytrain_ddp.data.splits import split
from raytrain_ddp.data.transforms import RECIPES, Prepared, transform_for
from raytrain_ddp.storage.object_path import ObjectPath

SYNTHETIC_SIZES = (4096, 1024)
"""Synthetic train and val sizes when --train-samples / --val-samples are not given."""


class Data(NamedTuple):
    train: Dataset
    val: Dataset
    in_channels: int



class SyntheticImages(Dataset):
    """Smooth per-class prototype images plus per-sample noise: learnable, generated from the seed.

    Samples are made on demand from (seed, split, index), so nothing is held in memory and every rank
    and every DataLoader worker produces the same sample for the same index.
    """

    random_streams = ()
    """No global stream: the noise comes from a generator of the sample's own."""

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
    train_size = cfg.train_samples or SYNTHETIC_SIZES[0]
    val_size = cfg.val_samples or SYNTHETIC_SIZES[1]
    make = lambda size, split: SyntheticImages(size, cfg.num_classes, cfg.image_size, cfg.seed, split)
    return Data(make(train_size, 0), make(val_size, 1), in_channels=3)


def from_files(cfg: TrainConfig, root: Path | ObjectPath | None = None) -> Data:
    """A dataset in --data-dir, read by its format's reader (READERS). `root`: --data-dir as the
    driver resolved it (dataset_checks.data_root), else resolved here."""
    return prepare(cfg, READERS[cfg.dataset](root or data_root(cfg)))


def parquet(cfg: TrainConfig, root: Path | ObjectPath | None = None) -> Data:
    data = from_files(cfg, root)
    # Load the image bytes now, in this process, so DataLoader workers share them after fork.
    for part in (data.train, data.val):
        part.samples.load_images()
    return data


DATASETS: dict[str, Callable[[TrainConfig], Data]] = {
    "synthetic": synthetic,
    "mnist": from_files,
    "cifar10": from_files,
    "tinyimagenet": from_files,
    "imagefolder": from_files,
    "parquet": parquet,
}


def dataset_builder(name: str, given: Callable[..., Any] | None = None,
                    root: Path | ObjectPath | None = None) -> Callable[[TrainConfig], Data]:
    """The builder for --dataset: a registry name, an import path, or a callable given by the Python
    API. `root`: a built-in dataset's --data-dir as the driver resolved it (dataset_checks.data_root)."""
    if given is None and not plugins.is_import_path(name):
        return DATASETS[name] if root is None else functools.partial(DATASETS[name], root=root)
    return functools.partial(user_dataset, name, given or plugins.load(name, "--dataset"))


def user_dataset(name: str, build: Callable[..., Any], cfg: TrainConfig) -> Data:
    """The user's CALLABLE(split=, data_dir=, image_size=), called for "train" and "val", checked.

    Used whole: --train-samples/--val-samples size the synthetic set and cap the built-in ones; a
    builder that wants fewer samples returns fewer."""
    splits = []
    for split_name in ("train", "val"):
        ds = build(split=split_name, data_dir=cfg.data_dir, image_size=cfg.image_size)
        if not (isinstance(ds, Dataset) and hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(
                f"--dataset {name} returned a value of type {type(ds).__name__} for split={split_name!r}; return a map-style "
                "torch.utils.data.Dataset (with __len__ and __getitem__) of (input tensor, class index) pairs"
            )
        if len(ds) == 0:
            raise ConfigError(f"--dataset {name} returned an empty {split_name} split")
        splits.append(ds)
    first = splits[0][0]
    if not (isinstance(first, (tuple, list)) and len(first) == 2 and torch.is_tensor(first[0]) and first[0].dim() >= 1):
        raise ConfigError(
            f"--dataset {name}: a sample must be (input tensor of 1 or more dimensions, class index); "
            f"got {type(first).__name__}"
        )
    return Data(splits[0], splits[1], in_channels=int(first[0].shape[0]))


def prepare(cfg: TrainConfig, layout: Layout) -> Data:
    """Split, cap and wrap a dataset read from disk with its transforms."""
    train, val = split(cfg, layout)
    recipe = RECIPES.get(layout.source, RECIPES["imagefolder"])
    shape = (layout.channels, cfg.image_size, cfg.image_size)

    def wrap(samples: Samples, is_train: bool) -> Prepared:
        make = functools.partial(transform_for, is_train, cfg.image_size, layout.image_size, recipe)
        return Prepared(samples, make, cfg.skip_bad, shape)

    return Data(wrap(train, True), wrap(val, False), layout.channels)
