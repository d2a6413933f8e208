"""Stragglers: which rank is slow, in which part of its steps, and by how much; and whether the ranks'
times can be compared at all.

Every epoch each rank sends its own seconds in data, forward, backward and comm, in total and per
window of its steps (worker/measure/part_clock.py). Each pass's first window is left out: it holds the
loader's start, and in the first epoch the warm-up. Over the windows left, a rank is slow in a part
when the gap to the others in it
- persists: the rank is slower in every window, not over one bad stretch;
- is larger than the noise: its smallest gap in a window exceeds how much the others' own time in
  the part moves from window to window;
- matters: 20% or more above the others (50% among CPU ranks that share a node), by at least 5% of
  their time in all parts (a few ms of data wait against 1 ms is no straggler);
- is the rank's own: ranks that share a node count the seconds a rank waited for a core (beyond
  the others' wait) as no gap, for those are the scheduler's.
"The others" in a window are the median of the other ranks: with 2 ranks, the other rank itself, not
a mean that the slow rank pulls halfway to itself. Only the ranks' own work (data, forward, backward)
names a rank: every rank leaves the all-reduce together, so a long `comm` is a rank waiting for a
slower one, not a slow one (a slow link slows every rank's all-reduce alike).

Ranks whose node has fewer cores than they keep busy (torch threads and loader workers) take turns
on the cores. Linux gives each of B busy threads on C cores at least C/B of a core, so taking turns
stretches a rank's work at most B/C times (`turns_bound`): a rank is named there only when its gap is
beyond that, both in the part (B/C times the 50% bar) and against the others' whole own step (B/C - 1
times it, which also bounds a wait for a starved loader). A gap within the bound names no rank, and
one line says that the ranks take turns (`not_comparable`).
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ddp.run_files import write_atomic

PARTS = ("data", "forward", "backward", "comm")
SLOWER = 0.20
"""A rank this much above the others in a part is slow in it ..."""
SHARED_SLOWER = 0.50
"""... or this much, for CPU ranks on one node: they share its cores, caches and memory, and gloo's
threads beside them (seen: rank 0 of the quick start at --data-workers 0, 2 ranks on 2 cores, 20-25%
slower in backward than rank 1 in every window, on a quiet machine) ..."""
FLOOR = 0.05
"""... when the difference is also at least this share of the others' time in all parts ..."""
MIN_WINDOWS = 3
"""... and it held in every one of at least this many windows (an epoch of fewer steps names no one)."""
OWN = ("data", "forward", "backward")
"""The parts that are a rank's own work, which alone can name it; `comm` includes waiting for the others."""
OWN_AT = slice(0, len(OWN))
"""Where the OWN parts sit in a window's seconds (PARTS' order)."""
RANK_TIMES = "rank_times.csv"
"""The run directory's file of every rank's parts, every epoch."""
RANK_WINDOWS = "rank_windows.csv"
"""The same per window of each epoch's steps."""


@dataclass(frozen=True)
class Straggler:
    epoch: int
    rank: int
    host: str
    part: str
    seconds: float
    """The rank's seconds in the part this epoch, over the windows judged."""
    others: float
    """The others' (the median of the other ranks', window by window)."""
    windows: int
    """The windows judged: the rank was slower in each."""
    peer: int | None
    """The other rank, when there are 2."""

    def gap(self) -> str:
        slower = f"{self.seconds / self.others - 1:.0%}" if self.others > 0 else "far"
        than = f"rank {self.peer}" if self.peer is not None else "the other ranks"
        return f"rank {self.rank} on {self.host} is {slower} slower than {than} in {self.part} in epoch {self.epoch}"

    def line(self) -> str:
        return (f"straggler: {self.gap()}, in each of {self.windows} windows of its steps "
                f"({self.seconds:.2f} s vs {self.others:.2f} s)")


def stragglers(epoch: int, parts: list[dict[str, Any]], hosts: list[str]) -> list[Straggler]:
    """The ranks slow in a part of their own work this epoch, beyond what taking turns on shared cores
    can explain."""
    return slow_ranks(epoch, parts, hosts, turns_explain=True)


def slow_ranks(epoch: int, parts: list[dict[str, Any]], hosts: list[str], turns_explain: bool) -> list[Straggler]:
    """The ranks whose own work is slow by the module's rule; `turns_explain`: whether ranks that share
    too few cores must be slower than taking turns can make them."""
    if len(parts) < 2:
        return []
    found = (slow_in(epoch, part, r, parts, hosts, turns_explain) for part in OWN for r in range(len(parts)))
    return [slow for slow in found if slow is not None]


def slow_in(epoch: int, part: str, r: int, parts: list[dict[str, Any]], hosts: list[str],
            turns_explain: bool = True) -> Straggler | None:
    """Rank r, if it is slow in `part` this epoch (the module's rule), judged on seconds per micro-batch
    in each window, as the last windows may hold fewer."""
    i = PARTS.index(part)
    others = [rank for o, rank in enumerate(parts) if o != r]
    judged = [w for w in range(1, len(parts[r]["windows"])) if all(rank["window_steps"][w] for rank in parts)]
    if len(judged) < MIN_WINDOWS:
        return None

    def per_step(rank: dict[str, Any], w: int) -> list[float]:
        return [seconds / rank["window_steps"][w] for seconds in rank["windows"][w]]

    def queued(rank: dict[str, Any], w: int) -> float:
        return rank["queued"][w] / rank["window_steps"][w]

    mine = [per_step(parts[r], w)[i] for w in judged]
    theirs = [statistics.median(per_step(rank, w)[i] for rank in others) for w in judged]
    steps = [statistics.median(sum(per_step(rank, w)) for rank in others) for w in judged]
    # Ranks on one node take turns on its cores when anything else keeps them busy: the time a rank
    # waited for a core beyond the others' is the scheduler's, not the rank's (seen: 20% "slower" in
    # backward on a busy 2-core machine). On a node of its own, a busy node is the rank's slowness.
    shares = r < len(hosts) and hosts[r] in {host_of(hosts, o) for o in range(len(parts)) if o != r}  # known to share
    turns = [max(0.0, queued(parts[r], w) - statistics.median(queued(rank, w) for rank in others)) if shares else 0.0
             for w in judged]
    gaps = [m - t - q for m, t, q in zip(mine, theirs, turns)]
    noise = statistics.median(spread([per_step(rank, w)[i] for w in judged]) for rank in others)
    slower = SHARED_SLOWER if shares and not parts[r]["gpu"] else SLOWER
    # Taking turns on too few cores stretches a rank's work at most this many times (turns_bound).
    stretch = turns_bound(parts, hosts).get(host_of(hosts, r), 1.0) if turns_explain else 1.0
    if (min(gaps) <= noise or sum(mine) - sum(turns) < stretch * (1 + slower) * sum(theirs)
            or sum(gaps) < FLOOR * sum(steps)):
        return None
    own = [statistics.median(sum(per_step(rank, w)[OWN_AT]) for rank in others) for w in judged]
    if sum(gaps) < (stretch - 1) * sum(own):
        return None
    counts = [parts[r]["window_steps"][w] for w in judged]
    seconds, others_seconds = (sum(v * n for v, n in zip(values, counts)) for values in (mine, theirs))
    return Straggler(epoch, r, host_of(hosts, r), part, seconds, others_seconds, len(judged),
                     1 - r if len(parts) == 2 else None)


def spread(values: list[float]) -> float:
    """How far a rank's time in a part moves from window to window: the largest step between neighbours."""
    return max(abs(b - a) for a, b in zip(values, values[1:]))


def crowded_nodes(parts: list[dict[str, Any]], hosts: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The ranks of each node whose ranks keep more threads busy than it has cores, by host."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    for r, rank in enumerate(parts):
        by_host.setdefault(host_of(hosts, r), []).append(rank)
    return {host: ranks for host, ranks in by_host.items() if len(ranks) > 1 and busy(ranks) > cores(ranks)}


def busy(ranks: list[dict[str, Any]]) -> int:
    return sum(rank["threads"] + rank["loader_workers"] for rank in ranks)


def cores(ranks: list[dict[str, Any]]) -> int:
    return max(rank["cores"] for rank in ranks)


def turns_bound(parts: list[dict[str, Any]], hosts: list[str]) -> dict[str, float]:
    """How many times slower taking turns can make a rank's work on each crowded node, by host: busy
    threads over cores, as Linux's fair scheduler gives each busy thread at least cores/busy of a core."""
    return {host: busy(ranks) / cores(ranks) for host, ranks in crowded_nodes(parts, hosts).items()}


def crowding(parts: list[dict[str, Any]], hosts: list[str]) -> str | None:
    """Which nodes' ranks share their cores, which makes their times comparable only beyond the turns
    they take; None when every node has a core for each busy thread of its ranks."""
    said = []
    for host, ranks in crowded_nodes(parts, hosts).items():
        each = " / ".join(sorted({f"{rank['threads']} torch + {rank['loader_workers']} loader" for rank in ranks}))
        said.append(f"the {len(ranks)} ranks on {host} keep {busy(ranks)} threads busy ({each} each) "
                    f"on {cores(ranks)} cores")
    return "; ".join(said) or None


def not_comparable(epoch: int, parts: list[dict[str, Any]], hosts: list[str]) -> str | None:
    """The line for ranks that differ as a straggler does, by no more than taking turns on their
    node's shared cores explains, so none is named; None when they have cores of their own
    (stragglers() judges them), differ by more (stragglers() names them), or do not differ (a quick
    start on a laptop keeps more threads busy than it has cores, and has nothing to say)."""
    shared = crowding(parts, hosts)
    if not shared:
        return None
    named = {(slow.rank, slow.part) for slow in stragglers(epoch, parts, hosts)}
    within = [slow for slow in slow_ranks(epoch, parts, hosts, turns_explain=False) if (slow.rank, slow.part) not in named]
    if not within:
        return None
    most = max(within, key=lambda straggler: straggler.seconds - straggler.others)
    return (f"rank times not comparable: {most.gap()}, but {shared}, and taking turns on them can explain that "
            "much, so it is not named a straggler; to compare them, give each rank its own cores "
            "(fewer --workers per node, --cpus-per-worker or --data-workers)")


def unevenness(parts: list[dict[str, Any]]) -> float:
    """How far the most uneven part stands from its median, as a share of the median rank's time."""
    if len(parts) < 2:
        return 0.0
    total = statistics.median(sum(rank[part] for part in PARTS) for rank in parts) or 1.0
    return max(
        (max(rank[part] for rank in parts) - statistics.median(rank[part] for rank in parts)) / total
        for part in PARTS
    )


def most_uneven(by_epoch: dict[int, list[dict[str, Any]]], hosts: list[str]) -> dict[str, Any] | None:
    """For summary.json: the epoch whose ranks differed the most, each rank's parts, and its stragglers."""
    if not by_epoch:
        return None
    epoch = max(sorted(by_epoch), key=lambda e: unevenness(by_epoch[e]))
    parts = by_epoch[epoch]
    return {
        "epoch": epoch,
        "ranks": [{"rank": r, "host": host_of(hosts, r), **{part: rank[part] for part in PARTS}}
                  for r, rank in enumerate(parts)],
        "stragglers": [s.line() for s in stragglers(epoch, parts, hosts)],
    }


def write_rank_times(run_dir: Path, by_epoch: dict[int, list[dict[str, Any]]], hosts: list[str]) -> None:
    """RANK_TIMES: one row per epoch and rank, its seconds in each part and what it keeps busy;
    RANK_WINDOWS: its seconds per window of the epoch's micro-batches, and its wait for a core."""
    seconds = ["data_s", "forward_s", "backward_s", "comm_s"]
    times = io.StringIO()
    out = csv.writer(times)
    out.writerow(["epoch", "rank", "host", *seconds, "threads", "loader_workers", "cores"])
    for epoch in sorted(by_epoch):
        for r, rank in enumerate(by_epoch[epoch]):
            busy = [rank["threads"], rank["loader_workers"], rank["cores"]]
            out.writerow([epoch, r, host_of(hosts, r), *(rank[p] for p in PARTS), *busy])
    windows = io.StringIO()
    out = csv.writer(windows)
    out.writerow(["epoch", "window", "rank", "host", "steps", *seconds, "queued_s"])
    for epoch in sorted(by_epoch):
        for w in range(len(by_epoch[epoch][0]["windows"])):
            for r, rank in enumerate(by_epoch[epoch]):
                out.writerow([epoch, w, r, host_of(hosts, r), rank["window_steps"][w], *rank["windows"][w],
                              rank["queued"][w]])
    write_atomic(run_dir / RANK_TIMES, times.getvalue())  # a local file or an object, whole
    write_atomic(run_dir / RANK_WINDOWS, windows.getvalue())


def host_of(hosts: list[str], rank: int) -> str:
    return hosts[rank] if rank < len(hosts) else "?"  # an epoch of a world larger than the latest
