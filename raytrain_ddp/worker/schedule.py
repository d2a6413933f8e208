"""The LR schedule, in samples trained: warmup, then a decay to the run's last sample.

Counted in samples, which do not depend on the world size, so a run resized mid-way (or resumed at
another --workers) sets every optimizer step the LR the uninterrupted run would have, where that
step ends.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from raytrain_ddp.config import TrainConfig


class Schedule(NamedTuple):
    """The LR schedule in samples trained. Warmup rises linearly over the first `warmup` samples;
    the decay then runs from `anchor` (where it had gone `anchor_progress` of its way) to `total`,
    the run's last sample. A rerun with another --epochs moves `total` and re-anchors where the run
    stands, so the LR goes on from where it was."""

    total: int
    warmup: int
    anchor: int
    anchor_progress: float


def new_schedule(cfg: TrainConfig, train_size: int) -> Schedule:
    warmup = round(cfg.warmup_epochs * train_size)
    return Schedule(total=cfg.epochs * train_size, warmup=warmup, anchor=warmup, anchor_progress=0.0)


def decay_progress(schedule: Schedule, samples: int) -> float:
    """How far the decay has gone after `samples`, from 0 to 1, clamped: no LR rises past the end."""
    span = max(1, schedule.total - schedule.anchor)
    progress = schedule.anchor_progress + (1 - schedule.anchor_progress) * (samples - schedule.anchor) / span
    return min(1.0, max(0.0, progress))


def lr_factor(schedule: Schedule, samples: int, kind: str) -> float:
    """The share of --lr for the optimizer step that ends after `samples` samples of the run."""
    if samples < schedule.warmup:
        return samples / schedule.warmup
    progress = decay_progress(schedule, samples)
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "step":  # x0.1 once past half of the decay, again past three quarters
        return 0.1 ** ((progress > 0.5) + (progress > 0.75))
    return 1.0


def stretched(schedule: Schedule, total: int, samples: int) -> Schedule:
    """`schedule` with its end moved to `total` from `samples` on, without a jump in the LR."""
    if total == schedule.total:
        return schedule
    if samples <= schedule.warmup:  # the decay has not begun: it simply ends elsewhere
        return schedule._replace(total=total)
    return Schedule(total, schedule.warmup, anchor=samples, anchor_progress=decay_progress(schedule, samples))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
