"""The driver's checks of --dataset, in seconds, before any worker starts: its name, --data-dir, its
files and labels, the input channels. torch-free: a built-in dataset's files are read by the same
readers the ranks use (formats.py), which import torch only to make a sample; only the user's own
dataset brings torch in, with its module.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from raytrain_ddp import plugins
from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.formats import Layout, read_layout, read_manifest
from raytrain_ddp.data.splits import split
from raytrain_ddp.storage.location import check_store, is_uri, storage_root
from raytrain_ddp.storage.object_path import ObjectPath

BUILT_IN_CHANNELS = {"synthetic": 3, "mnist": 1, "cifar10": 3, "tinyimagenet": 3, "imagefolder": 3}
"""in_channels of the built-in datasets, as their readers (data.formats) decode them; parquet's is in
its manifest."""
BUILT_IN = (*BUILT_IN_CHANNELS, "parquet")
"""Every built-in --dataset (registry.DATASETS has a builder for each)."""
FROM_FILES = tuple(name for name in BUILT_IN if name != "synthetic")
"""The built-in datasets read from --data-dir."""


def dataset_channels(cfg: TrainConfig, root: Path | ObjectPath | None = None) -> int | None:
    """in_channels for a fresh run, where it costs nothing to know; None for the user's own dataset.
    `root`: --data-dir as data_root resolved it, else resolved here."""
    if cfg.dataset in BUILT_IN_CHANNELS:
        return BUILT_IN_CHANNELS[cfg.dataset]
    if cfg.dataset == "parquet" and cfg.data_dir:
        return int(read_manifest(root or data_root(cfg))["channels"])
    return None


def validate(cfg: TrainConfig, root: Path | ObjectPath | None = None) -> None:
    """Driver-side checks that fail in seconds, before any worker starts (names the fix): the
    dataset's name, its files (with --download, fetched first if not already in --data-dir), or
    the user's dataset by import path (it must import). `root`: --data-dir as data_root resolved it."""
    own = plugins.is_import_path(cfg.dataset)
    if not own and cfg.dataset not in BUILT_IN:
        raise ConfigError(
            f"unknown --dataset {cfg.dataset!r}; choose one of {', '.join(BUILT_IN)}, or give your own as "
            "PKG.MODULE:CALLABLE"
        )
    if cfg.loader == "ray" and cfg.dataset != "parquet":
        how = f"`raytrain data convert SRC DST --format {cfg.dataset}`" if cfg.dataset in FROM_FILES else "`raytrain data convert`"
        raise ConfigError(f"--loader ray reads Parquet shards: write them with {how}, then pass --dataset parquet --data-dir DST")
    if cfg.dataset in FROM_FILES:
        check_files(cfg, root or data_root(cfg))
    if own:
        plugins.load(cfg.dataset, "--dataset")  # fails here, in one line, if it does not import


def data_root(cfg: TrainConfig) -> Path | ObjectPath:
    """--data-dir of a built-in dataset as a path: a local one, or for parquet an object store's on
    its filesystem, checked to answer (location.check_store). Resolved where the store's settings
    are, on the driver: a rank is handed the driver's (its environment is the raylet's)."""
    if not cfg.data_dir:
        raise ConfigError(f"--dataset {cfg.dataset} reads files: pass --data-dir DIR")
    if not is_uri(cfg.data_dir):
        return Path(cfg.data_dir).expanduser()
    if cfg.download:
        raise ConfigError(f"--download fetches into a local directory, not --data-dir {cfg.data_dir}; pass a local "
                          "--data-dir, or drop --download")
    if cfg.dataset != "parquet":
        # Only Parquet shards are read as a few large files, which an object store serves well;
        # the other formats are trees of small files, read by local paths.
        raise ConfigError(
            f"--dataset {cfg.dataset} reads a local or shared directory, not --data-dir {cfg.data_dir}: only --dataset "
            f"parquet reads from an object store; write its shards there with `raytrain data convert SRC "
            f"{cfg.data_dir} --format {cfg.dataset}`, and pass --dataset parquet"
        )
    root = storage_root(cfg.data_dir, flag="--data-dir")
    check_store(root, cfg.data_dir, flag="--data-dir")
    return root


def check_files(cfg: TrainConfig, root: Path | ObjectPath) -> None:
    """A built-in dataset's files under `root`: present (or downloaded with --download), labels
    within --num-classes, and the caps said when they leave samples out."""
    layout = read_layout(cfg.dataset, root, cfg.download)
    check_labels(cfg, layout)
    train, val = split(cfg, layout)
    full_train, full_val = split(dataclasses.replace(cfg, train_samples=0, val_samples=0), layout)
    if len(train) < len(full_train) or len(val) < len(full_val):
        print(
            f"note: using {len(train)} of {len(full_train)} train and {len(val)} of {len(full_val)} val samples "
            "(--train-samples, --val-samples); leave them out to use all",
            file=sys.stderr,
        )


def check_labels(cfg: TrainConfig, layout: Layout) -> None:
    if len(layout.classes) > cfg.num_classes:
        raise ConfigError(
            f"{cfg.data_dir} has {len(layout.classes)} classes but --num-classes is {cfg.num_classes}; "
            f"pass --num-classes {len(layout.classes)}"
        )
    for samples in (layout.train, layout.val):
        if samples is None or len(samples) == 0:
            continue
        bad = np.flatnonzero((samples.labels < 0) | (samples.labels >= cfg.num_classes))
        if len(bad):
            first = int(bad[0])
            raise ConfigError(
                f"label {samples.labels[first]} of {samples.source(first)} is outside --num-classes "
                f"{cfg.num_classes} ({len(bad)} such samples); pass --num-classes {int(samples.labels.max()) + 1} "
                "or fix the labels"
            )
