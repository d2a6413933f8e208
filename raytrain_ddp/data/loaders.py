"""This rank's Loaders from the ingest path that --loader names: the worker loop's one entry to data."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.batches import Loaders
from raytrain_ddp.data.registry import Data, dataset_builder
from raytrain_ddp.storage.object_path import ObjectPath


def make_loaders(
    cfg: TrainConfig, rank: int, world_size: int, cuda: bool, build: Callable[[TrainConfig], Data] | None = None,
    root: Path | ObjectPath | None = None,
) -> Loaders:
    """This rank's train and val batches: disjoint training shards of equal length on every rank (the
    torch path repeats up to world_size - 1 samples, the ray path drops up to world_size - 1 rows),
    and validation split with nothing repeated or dropped, so each val sample counts once. `root`:
    --data-dir as the driver resolved it, for the ray path and a built-in dataset's builder."""
    if cfg.loader == "ray":
        from raytrain_ddp.data.ray_ingest import (
            ray_loaders,  # Ray Data only where it is used
        )

        return ray_loaders(cfg, world_size, root)
    from raytrain_ddp.data.torch_ingest import torch_loaders

    return torch_loaders(cfg, rank, world_size, cuda, build or dataset_builder(cfg.dataset, root=root))
