"""--loader torch on a worker: every rank builds the same dataset and a DistributedSampler picks its shard."""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator

from torch.utils.data import DataLoader, DistributedSampler, Sampler, Subset

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.batches import Batches, Loaders, SkipCount
from raytrain_ddp.data.registry import Data, dataset_builder


class EpochSampler(Sampler[int]):
    """A DistributedSampler whose epoch can start after its first `skip` batches."""

    def __init__(self, sampler: DistributedSampler, batch_size: int):
        self.sampler, self.batch_size, self.start = sampler, batch_size, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)  # the order depends on (seed, epoch) only: a resumed epoch repeats it
        self.start = skip * self.batch_size

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)


def torch_loaders(
    cfg: TrainConfig, rank: int, world_size: int, cuda: bool, build: Callable[[TrainConfig], Data] | None = None
) -> Loaders:
    """This rank's train and val batches.

    Training shards are disjoint and of equal length on every rank: DistributedSampler repeats the
    first few samples of the shuffled order to even them out. Validation is split with no padding,
    so each val sample counts exactly once in the all-reduced metrics.
    """
    data = (build or dataset_builder(cfg.dataset))(cfg)
    shards = DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    sampler = EpochSampler(shards, cfg.batch_size)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=cfg.data_workers,
        pin_memory=cuda,  # pinned host memory only helps host-to-GPU copies
        persistent_workers=cfg.data_workers > 0,
    )
    train = DataLoader(data.train, sampler=sampler, **common)
    val = DataLoader(Subset(data.val, range(rank, len(data.val), world_size)), shuffle=False, **common)
    skips = SkipCount()

    def set_epoch(epoch: int, skip: int = 0) -> None:
        sampler.set_epoch(epoch, skip)
        skips.count = 0

    return Loaders(
        Batches(train, skips, train=True),
        Batches(val, skips, train=False),
        set_epoch,
        math.ceil(len(shards) / cfg.batch_size),
        data.in_channels,
        lambda: skips.count,
    )
