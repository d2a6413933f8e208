"""The `LaunchHub` actor, which the driver of `raytrain launch` places on its own node: where the
ranks' agents (launch/agent.py) and the driver meet.

Keyed by worker group: every (re)start of the group is a new attempt with its own rendezvous, so a
restart never meets a dead attempt's peers. The agents send their output lines through the hub, and
learn there, as soon as it happens, that the driver was signalled, that a peer failed, or that Ray
Train is about to resize the group.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.launch.records import (
    AttemptEnded,
    AttemptStarted,
    HubEvent,
    LaunchOutcome,
    OutputLine,
    RankExit,
    StartupMarks,
    StopReason,
)
from raytrain_ddp.ray_compat.state import lost_and_draining_nodes

EXITS_POLL_S = 0.2
"""How often a resize looks whether every rank of the running attempt has exited."""
RESIZE_MARGIN_S = 15.0
"""Beyond the grace: how long Ray Train's controller waits for the ranks' exits before a resize
(the agents' SIGKILL after the grace, then their reports), so a rank whose agent died already
delays the resize by a bounded time."""
NODE_CHECK_S = 1.0
"""How often the hub asks Ray whether a node of the running attempt died or is being drained."""
TEARDOWN_WAIT_S = 10.0
"""How long a rank's teardown abort waits for its peers' exits before it counts as a failure."""


@dataclass
class Attempt:
    """One worker group, as the hub keeps it."""

    number: int
    """In the order the groups formed, from 1."""
    world_size: int
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each rank's rendezvous info (launch/agent.py's `whereabouts`), by rank."""
    scripts: dict[int, int] = field(default_factory=dict)
    """Each rank's script pid, by rank, once its agent started it."""
    exits: dict[int, RankExit] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)
    """When each exit reached the hub (time.monotonic())."""
    formed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once every rank joined."""
    resize: StopReason | None = None
    """Set when Ray Train is about to resize the group while it runs."""

    def running(self) -> bool:
        return len(self.exits) < self.world_size

    def failed_first(self) -> int | None:
        """The rank whose script failed first, by when it ended, not by when its agent said so."""
        failed = [(e.ended_at, r) for r, e in self.exits.items() if e.failed and not self.excused(r)]
        return min(failed)[1] if failed else None

    def excused(self, rank: int) -> bool:
        """A teardown abort (torch's threads after the script's last line) fails nothing once every
        other rank exited 0: they all got through their last collective with it, so its training
        ended. While they may still do so (TEARDOWN_WAIT_S), it stops no one."""
        end = self.exits.get(rank)
        if end is None or not end.teardown_abort or self.world_size == 1:  # no peer to vouch for its end
            return False
        if any(e.code != 0 and not e.teardown_abort for r, e in self.exits.items() if r != rank):
            return False
        return not self.running() or time.monotonic() - self.arrived[rank] < TEARDOWN_WAIT_S


@ray.remote(num_cpus=0)
class LaunchHub:
    """Where the ranks meet: each attempt's rendezvous, their output on its way to the driver, their exits.

    An attempt is one worker group, named by a key its rank 0 drew: `--max-failures` restarts and
    elastic resizes make new ones. A stop (the driver was signalled) holds for every attempt,
    current and later; a peer's failure only for its own. Async, so agents can wait here for a stop
    while others send their lines.
    """

    def __init__(self) -> None:
        self.attempts: dict[str, Attempt] = {}
        self.last: Attempt | None = None
        self.events: list[HubEvent] = []
        self.stop: StopReason | None = None
        self.changed = asyncio.Event()
        self.watching = False
        self.told_startup = False

    async def join(self, key: str, rank: int, world_size: int, info: dict[str, Any]) -> dict[str, Any]:
        """Wait for every rank of this attempt; return its number and its peers, by rank."""
        if not self.watching:
            self.watching = True
            asyncio.get_running_loop().create_task(self._watch_nodes())
        attempt = self.attempts.setdefault(key, Attempt(len(self.attempts) + 1, world_size))
        attempt.peers[rank] = info
        if len(attempt.peers) == world_size:
            before, self.last = self.last, attempt
            first = before.failed_first() if before else None
            self.events.append(AttemptStarted(
                attempt.number, world_size,
                previous=before.exits[first] if first is not None else None,
                resized=before.resize.why if before and before.resize else None,
            ))
            attempt.formed.set()
        await attempt.formed.wait()
        return {"number": attempt.number, "peers": [attempt.peers[r] for r in range(world_size)]}

    def started(self, marks: dict[str, float]) -> None:
        """Rank 0's start-up marks (startup.py), once: for the driver's start-up line."""
        if not self.told_startup:
            self.told_startup = True
            self.events.append(StartupMarks(marks))

    def script_started(self, key: str, rank: int, pid: int) -> None:
        self.attempts[key].scripts[rank] = pid

    def any_script(self) -> bool:
        """Whether any rank's script has started, in any attempt."""
        return any(attempt.scripts for attempt in self.attempts.values())

    def ranks(self) -> list[RankProcess]:
        """Where each rank's script runs (hostname, ip, pid), by rank, while the last attempt runs
        with every script started and none ended (the stall watch's and `raytrain stack`'s ranks);
        else none."""
        attempt = self.last
        if attempt is None or attempt.exits or len(attempt.scripts) < attempt.world_size:
            return []
        return [RankProcess(r, attempt.peers[r]["hostname"], attempt.peers[r]["ip"], attempt.scripts[r])
                for r in range(attempt.world_size)]

    def output(self, rank: int, lines: list[tuple[str, str]]) -> None:
        self.events.extend(OutputLine(rank, stream, text) for stream, text in lines)

    async def exited(self, key: str, end: RankExit) -> None:
        attempt = self.attempts[key]
        attempt.exits[end.rank], attempt.arrived[end.rank] = end, time.monotonic()
        if end.teardown_abort:  # a peer stop, if its peers have not all exited 0 by then
            asyncio.get_running_loop().call_later(TEARDOWN_WAIT_S, self._wake)
        if not attempt.running():
            self.events.append(AttemptEnded(attempt.number, dict(attempt.exits), attempt.failed_first(),
                                            [r for r in attempt.exits if attempt.excused(r)], self.stop is not None))
        self._wake()

    async def excused(self, key: str, rank: int) -> bool:
        """Whether this rank's failure fails nothing (a teardown abort: Attempt.excused), once its
        peers all exited or TEARDOWN_WAIT_S passed; every failed rank asks, so its peers' exits are
        reported before Ray Train stops them."""
        attempt = self.attempts[key]
        while attempt.running() and time.monotonic() - attempt.arrived[rank] < TEARDOWN_WAIT_S:
            await asyncio.sleep(EXITS_POLL_S)
        return attempt.excused(rank)

    def _abort(self, attempt: Attempt | None) -> StopReason | None:
        if self.stop is not None or attempt is None:
            return self.stop
        first = attempt.failed_first()
        return attempt.resize or (StopReason.peer_failed(first) if first is not None else None)

    async def wait_abort(self, key: str, timeout_s: float, known: StopReason | None = None) -> StopReason | None:
        """Why this attempt's scripts must stop, as soon as that differs from `known` (what the agent
        already acted on: a second Ctrl-C turns a stop into a kill), or `known` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        attempt = self.attempts.get(key)
        while (reason := self._abort(attempt)) == known and (left := deadline - time.monotonic()) > 0:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return reason

    async def _watch_nodes(self) -> None:
        """A node of the running attempt that Ray drains (a spot reclaim, `ray drain-node`) or lost:
        every rank gets SIGTERM, with the grace, before Ray Train restarts them at the new size, so
        a script can snapshot first, as under torchrun's elastic agent."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(NODE_CHECK_S)
            attempt = self.last
            if attempt is None or attempt.resize is not None or not attempt.running():
                continue
            try:
                dead, draining = await loop.run_in_executor(None, lost_and_draining_nodes)
            except Exception:  # the GCS busy or restarting: ask again next time
                continue
            for peer in attempt.peers.values():
                gone = "lost" if peer["node_id"] in dead else "being drained" if peer["node_id"] in draining else None
                if gone:
                    attempt.resize = StopReason.resizing(f"node {peer['hostname']} ({peer['ip']}) is {gone}")
                    self._wake()
                    break

    async def resize(self, world_size: int, timeout_s: float) -> None:
        """Ray Train is about to restart the worker group at `world_size` ranks: if the last attempt
        is running and nothing else is stopping it, every rank gets SIGTERM; returns when all have
        exited (their agents SIGKILL a rank after the grace), or after timeout_s."""
        attempt = self.last
        if attempt is None or world_size == attempt.world_size or self._abort(attempt) is not None \
                or not attempt.running():
            return  # the first start, or a restart after the attempt already failed or was stopped
        attempt.resize = StopReason.resizing(f"room appeared for {world_size} ranks" if world_size > attempt.world_size
                                             else f"only {world_size} ranks fit now")
        self._wake()
        deadline = time.monotonic() + timeout_s
        while attempt.running() and time.monotonic() < deadline:
            await asyncio.sleep(EXITS_POLL_S)

    def request_stop(self, signal_name: str, kill: bool = False) -> None:
        """The driver was signalled; `kill` (a second Ctrl-C) is SIGKILL at once."""
        self.stop = StopReason.signalled(signal_name, kill)
        self._wake()

    def _wake(self) -> None:
        self.changed.set()

    def take_events(self) -> list[HubEvent]:
        events, self.events = self.events, []
        return events

    def outcome(self) -> LaunchOutcome:
        """The last attempt: each rank's exit, the first real failure, and whether a signal stopped it."""
        last = self.last
        return LaunchOutcome(
            attempts=len([a for a in self.attempts.values() if a.formed.is_set()]),
            world_size=last.world_size if last else None,
            exits=last.exits if last else {},
            failed_first=last.failed_first() if last else None,
            excused=[r for r in last.exits if last.excused(r)] if last else [],
            stop_signal=self.stop.received if self.stop else None,
            peers=[last.peers.get(r) for r in range(last.world_size)] if last else [],
        )


def hub_options(world_size: int) -> dict[str, Any]:
    """The hub's actor options for a run of at most `world_size` ranks."""
    # Each rank holds up to two calls in the hub at once: its agent's own (join, which waits for every
    # rank, then wait_abort or exited) and its listener's wait_abort. After a restart the dead
    # attempt's listener calls linger up to the agent's WAIT_S beside the new attempt's joins: 3 per
    # rank. A rank's output calls, the driver's and the controller's add a few more: headroom of one
    # per rank and 100. Ray's default for async actors (1,000) would let 1,000 ranks' joins wait for
    # a 1,001st that never runs; the floor keeps small runs as they were.
    return {"max_concurrency": max(1000, 4 * world_size + 100)}


def resize_notice(hub: Any, grace_s: float, world_size: int) -> None:
    """In Ray Train's controller, before it resizes the worker group (an elastic run that found room
    for more ranks, or fits fewer; ray_compat.before_resize): the running scripts get SIGTERM and the
    grace, as under torchrun's elastic agent, where Ray Train alone would kill them outright and lose
    the work since their last snapshot. Returns once they have exited."""
    timeout = grace_s + RESIZE_MARGIN_S
    ray.get(hub.resize.remote(world_size, timeout), timeout=timeout + RESIZE_MARGIN_S)
