"""The ranks' agreement, every few micro-batches, in one tiny all-reduce: whether to stop (the driver
asked, or the loss diverged) and whether Ray is draining a node of theirs (checkpoint, train on).

Counted in micro-batches, which every rank counts alike, so every rank agrees at the same one. The
loop checkpoints and stops only where an optimizer step ends, so a resume never meets
half-accumulated gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist

from raytrain_ddp import ray_compat
from raytrain_ddp.worker import host_sync

CONTROL_EVERY = 20
"""Micro-batches between the ranks' agreements on whether to stop (a signal, a node drain, a
non-finite loss), within the two bounds in seconds below."""
CONTROL_EVERY_S = 5.0
"""... and at most about this many seconds: slow steps (a big model on CPU, --grad-accum 8) agree
more often, so a stop lands well inside Slurm's USR1@120 grace."""
CONTROL_GAP_S = 0.25
"""... but at least about this many seconds apart: an agreement costs a round trip to the driver's
sink and an all-reduce, a millisecond or two, which 20 micro-batches of a few ms each would feel."""
FP16_BAD_LOSS_PATIENCE = 20
"""Under fp16 a non-finite loss on a few micro-batches in a row can pass (the GradScaler skips those
steps and backs off); this many in a row is a diverged run. fp32 and bf16 stop on the first."""


@dataclass
class Control:
    """What the ranks agreed so far. Not saved: a resumed run agrees afresh."""

    rank: int
    sink: Any
    """The driver's MetricsSink actor, which rank 0 asks whether to stop."""
    patience: int
    """Non-finite losses in a row that make a diverged run."""
    bad_step: torch.Tensor
    """The step (as displayed) where this pass diverged, 0 while it has not; on the device."""
    bad_run: torch.Tensor
    """Non-finite losses in a row up to `losses`; on the device."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """The losses since the last agreement, on the device: read there, in a few kernels for them all,
    instead of a few per micro-batch."""
    first: int = 0
    """The step (as displayed) of losses[0]."""
    next_at: int = 1
    """The pass's micro-batch of the next agreement; the first one also measures the pace."""
    stopping: bool = False
    """The ranks agreed to stop: they will, where this optimizer step ends, after a checkpoint."""
    drain_news: bool = False
    """A node drain not yet answered with a checkpoint."""
    drain_saved: bool = False
    """A drain was seen and answered (or is about to be): checkpoint once per drain, then train on."""

    @classmethod
    def new(cls, rank: int, sink: Any, amp_dtype: torch.dtype | None, device: torch.device) -> Control:
        patience = FP16_BAD_LOSS_PATIENCE if amp_dtype == torch.float16 else 1
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(rank, sink, patience, bad_step=zero, bad_run=zero)

    def new_pass(self) -> None:
        """An epoch's pass begins: its micro-batches count from 1, with nothing agreed yet."""
        self.bad_step, self.bad_run = torch.zeros_like(self.bad_step), torch.zeros_like(self.bad_run)
        self.next_at, self.stopping, self.drain_news, self.losses = 1, False, False, []

    def count(self, loss: torch.Tensor, step: int) -> None:
        """After each micro-batch (`step`, as displayed, one more than the last one's): kept for the
        next agreement."""
        if not self.losses:
            self.first = step
        self.losses.append(loss)

    def settle(self) -> None:
        """Fold the kept losses into the run of non-finite ones and the step where it first reached
        the patience, on the device (no host sync)."""
        if not self.losses:
            return
        bad = ~torch.isfinite(torch.stack(self.losses))
        at = torch.arange(len(self.losses), device=bad.device)
        last_good = torch.cummax(torch.where(bad, -1, at), 0).values  # -1: none since the last agreement
        run = torch.where(last_good >= 0, at - last_good, self.bad_run + at + 1)
        reached = run >= self.patience
        diverged = (self.bad_step == 0) & reached.any()
        self.bad_step = torch.where(diverged, self.first + reached.int().argmax(), self.bad_step).double()
        self.bad_run, self.losses = run[-1].double(), []

    def agree(self, step: int, epoch: int, pass_start: float) -> None:
        """At the pass's micro-batch `step`, if an agreement is due there; a diverged loss raises."""
        if step != self.next_at:
            return
        self.settle()
        with host_sync.allowed():
            stop, draining, elapsed = agree_to_stop(self.rank, self.sink, self.bad_step, self.patience, epoch, pass_start)
        self.stopping = self.stopping or stop
        self.drain_news = self.drain_news or (draining and not self.drain_saved)
        self.drain_saved = self.drain_saved or draining
        pace = max(elapsed / step, 1e-9)  # the slowest rank's seconds per micro-batch, the same number on every rank
        self.next_at = step + max(1, min(max(CONTROL_EVERY, int(CONTROL_GAP_S / pace)), int(CONTROL_EVERY_S / pace)))

    def at_epoch_end(self, epoch: int, pass_start: float) -> bool:
        """The pass's last agreement: whether to stop after the epoch's checkpoint."""
        self.settle()
        stop, _, _ = agree_to_stop(self.rank, self.sink, self.bad_step, self.patience, epoch, pass_start)
        return stop or self.stopping  # asked for after the epoch's last agreement


def agree_to_stop(
    rank: int, sink: Any, bad_step: torch.Tensor, patience: int, epoch: int, pass_start: float,
) -> tuple[bool, bool, float]:
    """All ranks learn, at the same micro-batch, whether the driver asked to stop, whether Ray says a
    node of theirs is being drained (checkpoint now, train on), and the slowest rank's seconds per
    pass so far (to space the next agreement); a diverged loss raises."""
    # A barrier over the ranks, like the all-reduce below: every rank calls it at the same step.
    preempted = ray_compat.node_draining()
    asked = rank == 0 and ray.get(sink.stop_requested.remote())
    elapsed = time.perf_counter() - pass_start
    flags = torch.tensor([float(asked), bad_step.item(), elapsed], dtype=torch.float64, device=bad_step.device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1] > 0:
        how = "non-finite" if patience == 1 else f"non-finite on {patience} micro-batches in a row"
        raise FloatingPointError(
            f"loss became {how} at epoch {epoch} step {int(flags[1])}; nothing was saved after "
            "it, the last good checkpoint is kept: lower --lr, or try --no-amp"
        )
    return bool(flags[0]), preempted, flags[2].item()
