"""A dataset read from disk, split and capped: the val split (the data's own, or --val-fraction held
out) and the --train-samples / --val-samples caps. The same fixed draws on the driver, which checks
them, and on every rank, which trains on them. torch-free.
"""

from __future__ import annotations

import numpy as np

from raytrain_ddp.config import ConfigError, TrainConfig
from raytrain_ddp.data.formats import Layout, Samples

SPLIT_SEED = 0
"""Seeds the held-out val split and the sample caps. Fixed, not --seed: runs compare on one val set."""


def split(cfg: TrainConfig, layout: Layout) -> tuple[Samples, Samples]:
    """(train, val): the data's own val split or --val-fraction held out, each capped by --*-samples."""
    train, val = layout.train, layout.val
    if val is None:
        train, val = hold_out(train, cfg.val_fraction)
    return cap(train, cfg.train_samples), cap(val, cfg.val_samples)


def hold_out(samples: Samples, fraction: float) -> tuple[Samples, Samples]:
    """(train, val) with a fixed random `fraction` of the samples in val."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(samples))
    n_val = round(len(samples) * fraction)
    if not 0 < n_val < len(samples):
        raise ConfigError(
            f"--val-fraction {fraction} of {len(samples)} samples leaves an empty split; "
            "add samples, change --val-fraction, or add a val/ folder"
        )
    return samples.select(np.sort(order[n_val:])), samples.select(np.sort(order[:n_val]))


def cap(samples: Samples, limit: int | None) -> Samples:
    """A fixed random subset of `limit` samples (None or 0 = all); random, so every class stays in it."""
    if not limit or limit >= len(samples):
        return samples
    keep = np.random.default_rng(SPLIT_SEED).permutation(len(samples))[:limit]
    return samples.select(np.sort(keep))
