"""Stragglers: which rank is slow, in which part of its steps, and by how much.

Every epoch each rank sends its own seconds in data, forward, backward and comm
(worker/part_clock.py). A rank 20% or more above the median rank in a part, by at least 5% of the
median rank's time in all parts, is slow in that part: the floor keeps a part that is a sliver of the
step (a few ms of data wait) from naming a rank over noise. The ranks' own work (data, forward,
backward) is judged first: a slow rank makes its peers wait in `comm`, so a long `comm` names a
rank only when no rank is slow in its own work.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLOWER = 0.20
"""A rank this much above the median rank in a part is slow in it ..."""
FLOOR = 0.05
"""... when the difference is also at least this share of the median rank's time in all parts."""
OWN = ("data", "forward", "backward")
"""The parts that are a rank's own work; `comm` includes waiting for the others."""
RANK_TIMES = "rank_times.csv"
"""The run directory's file of every rank's parts, every epoch."""


@dataclass(frozen=True)
class Straggler:
    epoch: int
    rank: int
    host: str
    part: str
    seconds: float
    """The rank's seconds in the part this epoch."""
    median: float
    """The median rank's."""

    def line(self) -> str:
        slower = f"{self.seconds / self.median - 1:.0%}" if self.median > 0 else "far"
        return (f"straggler: rank {self.rank} on {self.host} is {slower} slower than the median rank in {self.part} "
                f"in epoch {self.epoch} ({self.seconds:.2f} s vs {self.median:.2f} s)")


def stragglers(epoch: int, parts: list[dict[str, float]], hosts: list[str]) -> list[Straggler]:
    """The ranks slow in a part this epoch: in their own work, or else in communication."""
    if len(parts) < 2:
        return []
    floor = FLOOR * statistics.median(sum(rank.values()) for rank in parts)

    def slow(names: tuple[str, ...]) -> list[Straggler]:
        found = []
        for part in names:
            median = statistics.median(rank[part] for rank in parts)
            for r, rank in enumerate(parts):
                if rank[part] >= (1 + SLOWER) * median and rank[part] - median >= floor:
                    found.append(Straggler(epoch, r, host_of(hosts, r), part, rank[part], median))
        return found

    return slow(OWN) or slow(("comm",))


def unevenness(parts: list[dict[str, float]]) -> float:
    """How far the most uneven part stands from its median, as a share of the median rank's time."""
    if len(parts) < 2:
        return 0.0
    total = statistics.median(sum(rank.values()) for rank in parts) or 1.0
    return max(
        (max(rank[part] for rank in parts) - statistics.median(rank[part] for rank in parts)) / total
        for part in parts[0]
    )


def most_uneven(by_epoch: dict[int, list[dict[str, float]]], hosts: list[str]) -> dict[str, Any] | None:
    """For summary.json: the epoch whose ranks differed the most, each rank's parts, and its stragglers."""
    if not by_epoch:
        return None
    epoch = max(sorted(by_epoch), key=lambda e: unevenness(by_epoch[e]))
    parts = by_epoch[epoch]
    return {
        "epoch": epoch,
        "ranks": [{"rank": r, "host": host_of(hosts, r), **rank} for r, rank in enumerate(parts)],
        "stragglers": [s.line() for s in stragglers(epoch, parts, hosts)],
    }


def write_rank_times(path: Path, by_epoch: dict[int, list[dict[str, float]]], hosts: list[str]) -> None:
    """One row per epoch and rank: its seconds in each part."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["epoch", "rank", "host", "data_s", "forward_s", "backward_s", "comm_s"])
        for epoch in sorted(by_epoch):
            for r, rank in enumerate(by_epoch[epoch]):
                out.writerow([epoch, r, host_of(hosts, r), rank["data"], rank["forward"], rank["backward"], rank["comm"]])


def host_of(hosts: list[str], rank: int) -> str:
    return hosts[rank] if rank < len(hosts) else "?"  # an epoch of a world larger than the latest
