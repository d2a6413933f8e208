"""--loader torch on a worker: every rank builds the same dataset and a DistributedSampler picks its shard.

Exactness: the epoch's order depends only on (seed, epoch), and each training sample's random
augmentation only on (seed, epoch, sample index), never on which rank or loader worker draws it or
where the run resumed. So a resumed run, at any world size and with any --data-workers, trains on
exactly the samples, and the augmented images, that the uninterrupted run would have.

The augmentation draws from the global streams (torchvision's transforms draw from torch's CPU
generator, a user's from whichever they like), so each sample seeds the ones its dataset draws from:
all three unless it names fewer in a `random_streams` attribute, as ours do (a TensorDataset: none).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset, get_worker_info

from raytrain_ddp.config import LOADER_WORKERS, TrainConfig
from raytrain_ddp.data.batches import Batches, Loaders, SkipCount
from raytrain_ddp.data.loader_workers import worker_start
from raytrain_ddp.data.registry import DATASETS, Data, dataset_builder


def epoch_shard(n: int, world_size: int, rank: int, seed: int, epoch: int, start: int = 0) -> list[int]:
    """This rank's samples of an epoch, from global position `start` on.

    The epoch's order is DistributedSampler's (a permutation drawn from seed + epoch), so it is the
    same on every rank and at every world size. Rank r takes positions start + r, start + r + W, ...
    so after k batches of b the world has trained exactly positions [start, start + W*k*b): a resume
    at another world size starts there, and no sample is trained twice or skipped. As in
    DistributedSampler, the rest is evened out by repeating its first samples.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()[start:]
    if not order:
        return []
    pad = -len(order) % world_size
    order += (order * math.ceil(pad / len(order)))[:pad]
    return order[rank::world_size]


def trained_position(start: int, world_size: int, batch_size: int, batches: int, n: int) -> int:
    """The global position after every rank took `batches` more batches from `start`."""
    return min(n, start + world_size * batch_size * batches)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's random draws in one epoch: a function of nothing else."""
    return ((seed * 1_000_003 + epoch) << 32) + index


class Stream(NamedTuple):
    get_state: Callable[[], Any]
    set_state: Callable[[Any], None]
    seed: Callable[[int], Any]


STREAMS: dict[str, Stream] = {
    # The CPU generator alone: torch.manual_seed would also seed every device's, 100x the cost.
    "torch": Stream(torch.default_generator.get_state, torch.default_generator.set_state,
                    torch.default_generator.manual_seed),
    "python": Stream(random.getstate, random.setstate, random.seed),
    "numpy": Stream(np.random.get_state, np.random.set_state, lambda seed: np.random.seed(seed % 2**32)),
}
"""The global random streams a dataset's random transforms may draw from, by name."""


@contextlib.contextmanager
def seeded(seed: int, streams: tuple[str, ...], restore: bool) -> Iterator[None]:
    """The named global streams seeded for the block; with `restore`, given back after it, so the
    process's own streams (dropout, when the training process loads its own data) do not move."""
    saved = [(STREAMS[name].set_state, STREAMS[name].get_state()) for name in streams] if restore else []
    for name in streams:
        STREAMS[name].seed(seed)
    try:
        yield
    finally:
        for set_state, state in saved:
            set_state(state)


class PerSampleRandom(Dataset):
    """A training set read by (epoch, index) keys: each sample's augmentation, the built-in crops and
    flips or a user dataset's own random transforms, draws from sample_seed(seed, epoch, index)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        # torch's TensorDataset hands back the tensors it holds: it draws from no stream.
        self.streams = tuple(getattr(dataset, "random_streams", () if type(dataset) is TensorDataset else STREAMS))
        if unknown := set(self.streams) - set(STREAMS):
            raise ValueError(f"{type(dataset).__name__}.random_streams names {sorted(unknown)}: a tuple of "
                             f"{', '.join(STREAMS)} or fewer")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if not self.streams:  # a TensorDataset's read takes about as long as the context would
            return self.dataset[index]
        # A loader worker's streams feed nothing but this dataset, which seeds them for every sample:
        # giving them back there would only cost (NumPy's state alone takes 65 us to read and write).
        with seeded(sample_seed(self.seed, epoch, index), self.streams, restore=get_worker_info() is None):
            return self.dataset[index]


class EpochSampler(Sampler[tuple[int, int]]):
    """This rank's epoch_shard, set before each epoch, as (epoch, index) keys for PerSampleRandom."""

    def __init__(self, n: int, world_size: int, rank: int, seed: int):
        self.n, self.world_size, self.rank, self.seed = n, world_size, rank, seed
        self.epoch = 0
        self.indices: list[int] = []

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.indices = epoch_shard(self.n, self.world_size, self.rank, self.seed, epoch, start)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, index) for index in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def torch_loaders(
    cfg: TrainConfig, rank: int, world_size: int, cuda: bool, build: Callable[[TrainConfig], Data] | None = None
) -> Loaders:
    """This rank's train and val batches.

    Training shards are disjoint and of equal length on every rank (epoch_shard). Validation is
    split with no padding, so each val sample counts exactly once in the all-reduced metrics; a rank
    may get fewer val batches than another, or none.
    """
    data = (build or dataset_builder(cfg.dataset))(cfg)
    sampler = EpochSampler(len(data.train), world_size, rank, cfg.seed)
    samples = PerSampleRandom(data.train, cfg.seed)
    workers = cfg.data_workers if cfg.data_workers is not None else default_workers(cfg, samples)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=workers,
        pin_memory=cuda,  # pinned host memory only helps host-to-GPU copies
        persistent_workers=workers > 0,
    )
    if workers > 0:  # a forkserver's workers, not forks of this many-threaded rank (loader_workers.py)
        common["multiprocessing_context"] = worker_start([data.train, data.val])
    # Its own generator: a DataLoader seeds its workers from the global torch stream otherwise, and
    # a resumed run, which makes one more iterator, would then draw its dropout from another place.
    train = DataLoader(samples, sampler=sampler, generator=torch.Generator().manual_seed(cfg.seed), **common)
    val = DataLoader(Subset(data.val, range(rank, len(data.val), world_size)), shuffle=False, generator=torch.Generator(), **common)
    skips = SkipCount()

    def set_epoch(epoch: int, start: int = 0) -> int:
        sampler.set_epoch(epoch, start)
        skips.count = 0
        return math.ceil(len(sampler) / cfg.batch_size)

    return Loaders(
        Batches(train, skips, train=True, skip_bad=cfg.skip_bad),
        Batches(val, skips, train=False, skip_bad=cfg.skip_bad),
        set_epoch,
        math.ceil(math.ceil(len(data.train) / world_size) / cfg.batch_size),
        len(data.train),
        data.in_channels,
        lambda: skips.count,
        workers,
    )


IN_MEMORY_S = 10e-6
"""A training sample that reads in less than this is in memory already (a TensorDataset's row, not a
generated or decoded image: docs/data.md has the reads measured). Loader processes would give such a
rank nothing but, for each batch, the cost of moving it from one process to another, and more
processes to share the cores with."""
READS = (5, 8)
"""How a sample's read is timed: the best of 5 rounds of 8 reads (the best: a busy machine only adds)."""


def default_workers(cfg: TrainConfig, samples: PerSampleRandom) -> int:
    """The loader processes of a run that leaves --data-workers unset: LOADER_WORKERS for our own
    datasets, which generate or decode every sample; for the user's (--dataset MODULE:FN, or the
    Python API's), none where it is in memory already (IN_MEMORY_S). Which it is changes nothing that
    is trained: each sample's randomness is its own, in any process."""
    if cfg.dataset in DATASETS:
        return LOADER_WORKERS  # and reading ours here would import torchvision into the rank, 2 s
    rounds, reads = READS
    n, best = len(samples), math.inf
    try:
        started = time.perf_counter()
        samples[(0, 0)]  # plainly read from somewhere else (a file, a decoder): no need to look again
        if time.perf_counter() - started > 100 * IN_MEMORY_S:
            return LOADER_WORKERS
        for r in range(rounds):
            started = time.perf_counter()
            for i in range(reads):
                samples[(0, (r * reads + i) * 7919 % n)]
            best = min(best, (time.perf_counter() - started) / reads)
    except Exception:  # a bad sample is the loader's to report (--skip-bad), in any process
        return LOADER_WORKERS
    return 0 if best < IN_MEMORY_S else LOADER_WORKERS
