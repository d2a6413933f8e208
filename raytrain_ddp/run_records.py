"""What rank 0 of a `raytrain run` and its driver tell each other through the sink actor
(driver/run/sink.py), as typed records: a worker group's start, the resizes between groups, a step's
progress, and the run's state as the driver polls it. launch_records' sibling for `run`.

No torch and no Ray: rank 0, the sink and the driver each read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from raytrain_ddp.doctor.ranks import RankProcess


@dataclass(frozen=True)
class Resize:
    """A worker group that followed another: a restart at the same size, or a resize."""

    at: float
    """When (time.time()) the group that found it started, or the group's own record of it."""
    epoch: int
    position: int
    """Where the new group resumed: the epoch and the global sample position in it."""
    from_size: int
    to_size: int
    stall: bool = False
    """The stall watch ended the group before it (doctor/stall_watch.py)."""

    @property
    def reason(self) -> str:
        if self.stall:
            return "a worker group restarted after a stall"
        if self.to_size == self.from_size:
            return "a worker group restarted after a failure"
        return "a worker or its node was lost" if self.to_size < self.from_size else "the cluster had room for more workers"

    def line(self) -> str:
        """The driver's line for it."""
        when = time.strftime("%H:%M:%S", time.localtime(self.at))
        if self.to_size == self.from_size:
            where = "the start" if (self.epoch, self.position) == (1, 0) else f"epoch {self.epoch} after {self.position} samples"
            return f"restarted: {self.to_size} workers at {when}, from {where} ({self.reason})"
        return (
            f"resized: {self.from_size} -> {self.to_size} workers at {when}, epoch {self.epoch} after {self.position} "
            f"samples ({self.reason}); the epoch goes on from there, re-sharded"
        )

    def to_json(self) -> dict[str, Any]:
        """As rank 0's checkpoints and summary.json keep it."""
        return {"at": self.at, "epoch": self.epoch, "position": self.position, "from": self.from_size,
                "to": self.to_size, **({"stall": True} if self.stall else {})}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Resize:
        return cls(at=record["at"], epoch=record["epoch"], position=record["position"], from_size=record["from"],
                   to_size=record["to"], stall=bool(record.get("stall")))


@dataclass(frozen=True)
class GroupStart:
    """Rank 0's word that a worker group started: who it is and where it resumed."""

    world_size: int
    backend: str
    ranks: tuple[RankProcess, ...]
    steps_per_epoch: int
    resumed_at: tuple[int, int, int] | None = None
    """Epoch, global sample position, and that position as this world's step count; None for a fresh start."""
    resizes: tuple[dict[str, Any], ...] = ()
    """The resizes the group's checkpoint holds (Resize.to_json each), its own for this start last."""
    startup: dict[str, float] = field(default_factory=dict)
    """Rank 0's start-up marks: stage -> time.time() (driver/core/startup.py)."""


@dataclass(frozen=True)
class Step:
    """Rank 0's latest step, for the driver's progress line."""

    epoch: int
    step: int
    loss: float
    at: float
    samples_per_s: float


@dataclass(frozen=True)
class RunState:
    """What the sink holds when the driver polls it: the run so far, as rank 0 told it."""

    world_size: int | None = None
    backend: str | None = None
    ranks: tuple[RankProcess, ...] = ()
    steps_per_epoch: int | None = None
    phase: str | None = None
    """None in training steps; "first step", "validation", "checkpoint" otherwise, and "finished" once
    the ranks left their loop (Ray Train then uploads the last checkpoint)."""
    resumed_at: tuple[int, int, int] | None = None
    resizes: tuple[Resize, ...] = ()
    startup: dict[str, float] | None = None
    """The first worker group's start-up marks."""
    reached: dict[str, float] = field(default_factory=dict)
    """Rank 0's start-up marks as it takes them, before its group's start (`startup`) has them all:
    for the start's live line."""
    first_step_unix: float | None = None
    """When the run's first step ended (time.time()): the start-up's end, as benchmarks measure it."""
    drain_saved: tuple[int, int] | None = None
    """Epoch and position of the checkpoint taken when Ray announced a node drain."""
    rank_parts: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    """Each epoch's seconds per rank in data, forward, backward and communication (worker/measure/part_clock.py)."""
    health: tuple[dict[str, Any], ...] | None = None
    """The pre-flight health check's per-node records (doctor/health.py's NodeHealth.to_json)."""
    profiles: dict[int, str] = field(default_factory=dict)
    """Each rank's --profile line."""
    config_error: str | None = None
    """A rank's ConfigError, which every retry would raise again."""
    stopped_at: tuple[int, int] | None = None
    """Epoch and step where the ranks stopped at the driver's request, with a checkpoint."""
    step: Step | None = None
    """Rank 0's latest step in an epoch not yet reported."""
    rows: tuple[dict[str, Any], ...] = ()
    """Every epoch's row so far, in epoch order (metrics.csv's)."""

    @property
    def hosts(self) -> list[str]:
        return [r.host for r in self.ranks]
