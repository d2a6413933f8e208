"""The training state: where the run stands and what it has counted, in one object that a checkpoint
saves (state_dict) and a resume loads (load_state_dict). The model, optimizer, loss scaler and RNG
streams are saved beside it (checkpoint/checkpointer.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.schedule import Schedule, new_schedule, stretched


@dataclass
class TrainState:
    """Positions are global (the same at any world size), so any world size resumes from it, and
    the samples already trained are never trained again."""

    schedule: Schedule
    """The LR schedule in samples trained; a rerun with another --epochs stretches it."""
    sums: torch.Tensor
    """(loss x n, correct, n) of `epoch` so far, float64 on the device (no host sync per micro-batch):
    this rank's own since its pass began, plus, on rank 0 of a resumed run, the world's before."""
    world_size: int
    """The ranks training now; a checkpoint records the world that saved it."""
    train_size: int
    """Training samples in an epoch, the end of its global positions. Not saved: the data says it."""
    epoch: int = 1
    """The epoch under way, or the next to start once one ended."""
    position: int = 0
    """Samples of `epoch` the whole world has trained, in the epoch's global order."""
    train_time: float = 0.0
    """Seconds of `epoch` spent training, without its checkpoints."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """metrics.csv's rows so far, one per epoch ended."""
    resizes: list[dict[str, Any]] = field(default_factory=list)
    """The run's world-size changes so far: where (epoch, position), from, to, and when."""

    @classmethod
    def fresh(cls, cfg: TrainConfig, train_size: int, world_size: int, device: torch.device) -> TrainState:
        zeros = torch.zeros(3, dtype=torch.float64, device=device)
        return cls(new_schedule(cfg, train_size), zeros, world_size, train_size)

    @property
    def samples(self) -> int:
        """Samples of the run trained so far: the schedule's clock."""
        return (self.epoch - 1) * self.train_size + self.position

    def count(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one micro-batch to the running sums, on the device. The count stays a Python number:
        a scalar tensor made for the device is a blocking copy, which would wait for the queued step."""
        n = len(labels)
        correct = (logits.argmax(1) == labels).sum()
        self.sums += torch.stack([(loss * n).double(), correct.double(), loss.new_full((), n, dtype=torch.float64)])

    def next_epoch(self) -> None:
        """The epoch ended: the next starts at its first sample, with nothing counted."""
        self.epoch, self.position, self.train_time = self.epoch + 1, 0, 0.0
        self.sums = torch.zeros_like(self.sums)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it. Every rank calls it at the same step: the sums saved are the
        world's (one all-reduce), so any world size can resume the epoch's running totals."""
        sums = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(sums)
        return {
            "schedule": self.schedule._asdict(),
            "epoch": self.epoch,  # the epoch to continue with ...
            "position": self.position,  # ... after this many of its samples, in its global order
            "sums": sums.cpu(),
            "train_time": self.train_time,
            "world_size": self.world_size,
            "resizes": self.resizes,
            "rows": self.rows,
        }

    def load_state_dict(self, saved: dict[str, Any], rank: int) -> None:
        """Go on from a checkpoint's state, saved at any world size: another one is a resize, and the
        world's running totals go to rank 0 alone, so they count once."""
        self.epoch, self.position = saved["epoch"], saved["position"]
        # this run's --epochs, which may differ from the saved run's, ends the decay
        self.schedule = stretched(Schedule(**saved["schedule"]), self.schedule.total, self.samples)
        self.train_time, self.rows, self.resizes = saved["train_time"], saved["rows"], list(saved["resizes"])
        if saved["world_size"] != self.world_size:
            self.resizes.append({
                "epoch": self.epoch, "position": self.position, "from": saved["world_size"], "to": self.world_size,
                "at": time.time(),
            })
        if rank == 0:
            self.sums = saved["sums"].to(self.sums.device)
