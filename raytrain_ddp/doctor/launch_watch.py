"""`raytrain launch`'s stall watch. A user's script reports no steps, so the sign of a stall is its
stacks: when no rank's Python stack (its main thread's, read with py-spy) changed for
--stall-timeout seconds and at least one rank waits in a torch.distributed collective, the run is
stalled. Then, as `raytrain run`'s watch does (stall_watch.py's diagnose), every rank's stack goes to
<run dir>/stall/, the rank not where the others wait is named, and the scripts are killed: a
failure Ray Train restarts the group from under --max-failures (or an elastic run), the run's end
once past that budget.

It also keeps <run dir>/workers.json, so `raytrain stack` can find the scripts.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from raytrain_ddp.doctor.diagnosis import is_stack, moving, read_place, training_stack
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stacks import dump_stacks, glance
from raytrain_ddp.doctor.stall_watch import Report, compile_limit, diagnose, restart_count, stall_folder, stall_limit
from raytrain_ddp.doctor.workers import write_workers
from raytrain_ddp.stops import Stalled
from raytrain_ddp.storage.location import RunPath

SCRIPT_SILENCE = "no rank's Python stack changed"
"""What a stalled script did not do: it reports no steps."""
MOST_BETWEEN_LOOKS_S = 15.0
"""The longest wait between two looks at every rank's stack."""


def between_looks(limit: float) -> float:
    """Seconds between two looks: a quarter of the limit, so a stall is said at most a quarter of
    the limit late, and only after at least 4 looks found every rank where it was (a rank that moves
    is unlikely to be caught on the same line 4 times); at most 15 s, which keeps the default
    (120 s) within the limit + 30 s. A look is cheap: py-spy reads each rank without pausing it."""
    return min(limit / 4, MOST_BETWEEN_LOOKS_S)


class StackWatch:
    """Polled by the driver core with the hub's news: where the scripts run, and their stacks."""

    def __init__(self, hub: Any, timeout: float | None, run_dir: RunPath, say: Callable[[str], None], restarts: int = 0) -> None:
        self.hub, self.run_dir, self.say, self.restarts = hub, run_dir, say, restarts
        self.limit = stall_limit(timeout, [])  # a script has no steps to measure: 120 s by default, None when off
        self.ranks: list[RankProcess] = []
        self.stacks: list[tuple[Any, ...]] = []
        """Each rank's training stack at the last look."""
        self.since: list[float] = []
        """Since when (time.monotonic()) each rank's stack has been the one in `stacks`."""
        self.next_look = 0.0
        self.read = False
        """Whether a look read any stack of this worker group's scripts."""
        self.told_blind = False
        self.told_compiling = False
        self.stalled: Stalled | None = None
        self.stalls: list[Report] = []
        """The stalls Ray Train restarted the scripts from (and the last, if it ended the run)."""

    def poll(self) -> None:
        """Note a new worker group's scripts (workers.json); every few seconds look at their stacks,
        and raise Stalled, after the diagnosis, when none moved for the limit."""
        import ray

        if self.stalled is not None:  # the core's last poll, after the stall ended the watch
            raise self.stalled
        ranks = ray.get(self.hub.ranks.remote())
        if ranks != self.ranks:
            self.new_group(ranks)
        if self.limit is None or not ranks or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + between_looks(self.limit)
        texts = dump_stacks(ranks, glance)
        if not self.read and not any(map(is_stack, texts)) and not self.told_blind:
            self.told_blind = True  # py-spy missing, or not allowed to read other processes (ptrace)
            self.say(f"the stall watch cannot read the scripts' stacks, so it will see no stall: {texts[0].splitlines()[0]}")
        self.read = self.read or any(map(is_stack, texts))
        still = self.still_for(texts)
        if still >= self.limit and any(read_place(text).collective for text in texts):
            if self.compiling(ranks, texts, still):
                return
            report = diagnose(ranks, texts, still, stall_folder(self.run_dir, self.stalls), self.say,
                              silence=SCRIPT_SILENCE)
            self.stalls.append(report)
            if len(self.stalls) > self.restarts:
                self.stalled = Stalled(report.line)
                raise self.stalled
            self.stacks, self.since = [], []  # the killed scripts: count again from the restarted ones
            self.say(f"{report.line}; the scripts were ended: Ray Train restarts them "
                     f"({restart_count(self.stalls, self.restarts)})")

    def compiling(self, ranks: list[RankProcess], texts: list[str], still: float) -> bool:
        """Whether the still ranks wait for one inside torch.compile, within `compile_limit`: said once."""
        seen = moving(ranks, texts, [[] for _ in ranks], still, SCRIPT_SILENCE)
        if seen is None or seen.kind != "compiling" or still >= compile_limit(self.limit or 0):
            return False
        if not self.told_compiling:
            self.told_compiling = True
            self.say(f"{seen.line}; the stall watch allows it {compile_limit(self.limit or 0):.0f} s")
        return True

    def new_group(self, ranks: list[RankProcess]) -> None:
        """A new attempt's scripts (or the end of one's): note where they run, and count from nothing."""
        self.ranks, self.stacks, self.since, self.read, self.told_compiling = ranks, [], [], False, False
        if ranks:
            write_workers(self.run_dir, ranks)
        # The first look a while after the scripts started: py-spy cannot read an interpreter that
        # is still starting, which would read as a watch that cannot see.
        self.next_look = time.monotonic() + between_looks(self.limit or 0)

    def still_for(self, texts: list[str]) -> float:
        """Seconds for which no rank's stack changed, as far as the looks tell."""
        now = time.monotonic()
        if not all(map(is_stack, texts)):  # a script ended, or py-spy could not read one: no stall to tell
            self.stacks, self.since = [], []
            return 0.0
        stacks = [training_stack(text) for text in texts]
        if len(self.stacks) != len(stacks):
            self.stacks, self.since = stacks, [now] * len(stacks)
        self.since = [since if old == new else now for old, new, since in zip(self.stacks, stacks, self.since)]
        self.stacks = stacks
        return now - max(self.since)
