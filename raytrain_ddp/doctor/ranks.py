"""Where a rank runs: the record the doctor finds a rank by (its node's IP and its pid) and names it
by (its rank and host), as the ranks announce themselves (worker/loop.py, the launch hub) and as
workers.json keeps them for `raytrain stack`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RankProcess:
    """One rank's process."""

    rank: int
    host: str
    """Its node's hostname."""
    ip: str
    """Its node's IP, as Ray knows the node: where a look at its stack must run."""
    pid: int
    nice: int = 0
    """Its niceness: Ray starts workers at 15 unless told otherwise (driver/session/head.py)."""

    def label(self) -> str:
        return f"rank {self.rank} on {self.host} pid {self.pid}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, rank: int, record: dict[str, Any]) -> RankProcess:
        """A rank's announcement or workers.json entry (`hostname` in the ranks' own words and in
        the workers.json of runs before this record)."""
        return cls(rank=record.get("rank", rank), host=record.get("host") or record["hostname"], ip=record["ip"],
                   pid=record["pid"], nice=record.get("nice", 0))


def ranks_from(records: list[dict[str, Any]]) -> list[RankProcess]:
    """The ranks, in rank order, from their announcements."""
    return [RankProcess.from_json(rank, record) for rank, record in enumerate(records)]
