"""The driver's checks of --dataset, in seconds, before any worker starts: its name, --data-dir, its
files, the input channels. torch-free where no file is read (the synthetic set, the user's own), so
such a run's driver never imports torch; a built-in dataset's files are read by registry.py.
"""

from __future__ import annotations

from pathlib import Path

from raytrain_ddp import plugins
from raytrain_ddp.config import ConfigError, TrainConfig

BUILT_IN_CHANNELS = {"synthetic": 3, "mnist": 1, "cifar10": 3, "tinyimagenet": 3, "imagefolder": 3}
"""in_channels of the built-in datasets, as their readers (data.formats) decode them; parquet's is in
its manifest."""
BUILT_IN = (*BUILT_IN_CHANNELS, "parquet")
"""Every built-in --dataset (registry.DATASETS has a builder for each)."""
FROM_FILES = tuple(name for name in BUILT_IN if name != "synthetic")
"""The built-in datasets read from --data-dir."""


def dataset_channels(cfg: TrainConfig) -> int | None:
    """in_channels for a fresh run, where it costs nothing to know; None for the user's own dataset."""
    if cfg.dataset in BUILT_IN_CHANNELS:
        return BUILT_IN_CHANNELS[cfg.dataset]
    if cfg.dataset == "parquet" and cfg.data_dir:
        from raytrain_ddp.data.formats import read_manifest  # torch: a parquet run reads files anyway

        return int(read_manifest(Path(cfg.data_dir).expanduser())["channels"])
    return None


def validate(cfg: TrainConfig) -> None:
    """Driver-side checks that fail in seconds, before any worker starts (names the fix): the
    dataset's name, its files (with --download, fetched first if not already in --data-dir), or
    the user's dataset by import path (it must import)."""
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
        from raytrain_ddp.data.registry import check_files  # torch: the readers

        check_files(cfg)
    if own:
        plugins.load(cfg.dataset, "--dataset")  # fails here, in one line, if it does not import
