"""What the worker loop iterates, from either ingest path: a rank's batches, minus unreadable samples."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, NamedTuple

import torch

UNREADABLE = -1
"""Label of a sample that failed to decode under --skip-bad: Batches drops it and counts it."""


class Loaders(NamedTuple):
    """What the worker loop iterates: batches of (images, labels) for this rank only."""

    train: Iterable
    val: Iterable
    set_epoch: Callable[[int, int], int]
    """set_epoch(epoch, start=0), before each epoch: this epoch's order, the same on every rank, from
    global position `start` (the samples the world already trained this epoch, at whatever world
    size); returns how many batches this rank takes."""
    steps_per_epoch: int
    """A whole epoch's batches per rank at this world size."""
    train_size: int
    """Training samples in an epoch: the end of its global positions."""
    in_channels: int
    skipped: Callable[[], int]
    """Unreadable samples this rank dropped so far this epoch (train + val; only with --skip-bad)."""
    loader_workers: int
    """The loader's worker processes per rank (0: it loads in the rank)."""


class SkipCount:
    def __init__(self) -> None:
        self.count = 0


class Batches:
    """One split's (images, labels) batches for this rank; iterate once per epoch.

    Rows labelled UNREADABLE (--skip-bad) are dropped and counted. A training batch is never dropped
    whole: DDP needs the same number of steps on every rank, or its all-reduce waits forever.
    """

    def __init__(self, source: Iterable, skips: SkipCount, train: bool, skip_bad: bool):
        self.source, self.skips, self.train, self.skip_bad = source, skips, train, skip_bad

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.skip_bad:  # an unreadable sample raised where it was read: no batch holds one
            yield from self.source
            return
        for images, labels in self.source:
            bad = labels == UNREADABLE
            n_bad = int(bad.sum())
            if n_bad:
                self.skips.count += n_bad
                if n_bad == len(labels):
                    if not self.train:
                        continue
                    raise RuntimeError(
                        f"all {n_bad} samples of a training batch were unreadable ({self.skips.count} skipped "
                        "this epoch on this rank); most of --data-dir is bad, check it"
                    )
                images, labels = images[~bad], labels[~bad]
            yield images, labels
