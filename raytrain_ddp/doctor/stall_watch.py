"""`raytrain run`'s stall watch: when no rank has finished a training step (or an epoch's validation
has not moved) for --stall-timeout seconds, dump every rank's Python stack with py-spy, say where
each rank is and which one the others wait for, end the ranks and fail the run, instead of waiting
out the collective's timeout (30 min).
Where Ray Train may restart the worker group (--max-failures, an elastic run), a stall is one such
failure: the ranks are ended and the group restarts from the latest checkpoint. A stop the ranks do
not answer in time (driver/run/news.py) gets the same report.

A step is known from rank 0's beats to the sink (sink.py: a step update about once a second, a
validation batch at most once a second, and the end of a checkpoint, whose writing is no stall).
Under DDP rank 0 cannot finish a step while any rank is stuck, so its silence is the world's; in
validation it can, until the collective that ends it.

A rank's DataLoader workers are read too (its child processes): a rank that waits on its loader
is stuck where they are. `diagnose` is shared with `raytrain launch`'s watch (launch_watch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from raytrain_ddp.doctor.diagnosis import (
    STEP_SILENCE, LoaderWorker, Moving, culprit_ranks, is_stack, loader_finding, loader_place, moving, read_place,
    silence_in, silent_for, training_stack, verdict, worker_label,
)
from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stacks import dump_loader_workers, dump_stacks, end_ranks
from raytrain_ddp.stops import Stalled

MIN_STALL_S = 120.0
"""The default stall timeout's floor: a first epoch's loader start or a slow step is no stall."""
SLOW_STEPS = 10
"""... and the default is at least this many of the slowest recent gaps between steps."""
COMPILE_LIMITS = 10
"""A rank inside torch.compile may be silent this many stall limits ..."""
COMPILE_MIN_S = 1800.0
"""... and at least this long: a large model's compile warm-up takes tens of minutes."""

def compile_limit(limit: float) -> float:
    """The silence allowed while a rank compiles and its peers wait for it."""
    return max(COMPILE_LIMITS * limit, COMPILE_MIN_S)


def stall_limit(timeout: float | None, gaps: list[float]) -> float | None:
    """The seconds of silence that make a stall: --stall-timeout, or by default the longer of 2
    minutes and 10 of the slowest recent steps; None when the watch is off (0)."""
    if timeout == 0:
        return None
    return timeout if timeout is not None else max(MIN_STALL_S, SLOW_STEPS * max(gaps, default=0.0))


@dataclass(frozen=True)


class Report:
    """One diagnosed stall, as summary.json's `stalls` lists it."""

    at: float
    """When it was diagnosed (time.time())."""
    quiet_s: float | None
    """Seconds rank 0 had finished no training step, or no validation batch (None: it was writing a
    checkpoint, or had finished no step yet)."""
    culprits: list[int]
    """The ranks not where the others wait."""
    line: str
    """The verdict: who is where."""
    stacks: str
    """The folder of the ranks' stacks: stall/ for the run's first, stall-2/ for its second, ..."""


class StallWatch:
    """Asks the sink how long rank 0 has been silent, and diagnoses each stall: the first one past
    `restarts` fails the run; the ones before are failures Ray Train restarts the group from."""

    def __init__(self, sink: Any, timeout: float | None, run_dir: Path, say: Callable[[str], None], restarts: int = 0) -> None:
        self.sink, self.timeout, self.run_dir, self.say, self.restarts = sink, timeout, run_dir, say, restarts
        self.stalls: list[Report] = []
        """The stalls the run recovered from (and the last, if it failed it)."""
        self.quiet = 0.0
        """The silence at the last check: one shorter than it means rank 0 beat since."""
        self.next_look = 0.0
        """The silence at which to look again at ranks found slow or compiling in this silence."""
        self.told: set[str] = set()
        """What this silence was said to be (Moving.kind): each is said once."""

    def check(self, ranks: list[RankProcess]) -> None:
        """Raise Stalled, after the diagnosis, when the run is stalled and may not restart."""
        if self.timeout == 0 or not ranks:
            return
        import ray

        quiet, gaps, phase = ray.get(self.sink.quiet.remote())
        limit = stall_limit(self.timeout, gaps)
        if quiet is None or limit is None:
            return
        if quiet < self.quiet:  # rank 0 beat since the last check: a new silence, judged afresh
            self.next_look, self.told = 0.0, set()
        self.quiet = quiet
        if quiet < max(limit, self.next_look):
            return
        stacks = dump_stacks(ranks)
        if not any(map(is_stack, stacks)):
            # No rank's process is there: Ray Train is ending or restarting the worker group (a
            # failure, a resize, our own end of a stalled group), which is no stall. Count again from
            # now; the new group's start (sink.start) restarts the count anyway.
            self.sink.phase.remote(None)
            return
        workers, silence = dump_loader_workers(ranks), silence_in(phase)
        if self.moves(moving(ranks, stacks, workers, quiet, silence), quiet, limit):
            return
        if (self.told or phase == "first step") and moved_on(ranks, stacks):
            # Slow or compiling until now, and its stacks still change: caught in passing as a rank
            # leaves its compile (seen: one rank past it, the other not yet out of the all-reduce).
            # Before the first step, a rank still building its model or data while the others wait
            # for it in DDP's start is slow, not stuck, as long as it moves.
            self.next_look = quiet + limit
            return
        report = diagnose(ranks, stacks, quiet, stall_folder(self.run_dir, self.stalls), self.say, silence, workers)
        self.stalls.append(report)
        if len(self.stalls) > self.restarts:
            raise Stalled(report.line)
        self.sink.ended_for_stall.remote()
        self.say(f"{report.line}; the ranks were ended: Ray Train restarts them from the latest checkpoint "
                 f"({restart_count(self.stalls, self.restarts)})")

    def moves(self, seen: Moving | None, quiet: float, limit: float) -> bool:
        """Whether the ranks are slow or compiling rather than stalled: say so once, and look again
        a limit later. A compile gets `compile_limit`; a run that is slow is never ended for it."""
        if seen is None or (seen.kind == "compiling" and quiet >= compile_limit(limit)):
            return False
        if seen.kind not in self.told:
            self.told.add(seen.kind)
            allowed = (f"allowed {compile_limit(limit):.0f} s of silence" if seen.kind == "compiling"
                       else "never ended for it")
            self.say(f"{seen.line}; the stall watch looks again in {limit:.0f} s ({seen.kind} is {allowed})")
        self.next_look = quiet + limit
        return True

    def report_now(self, ranks: list[RankProcess]) -> Report:
        """Diagnose the ranks as stalled now, whatever the timeout (the watch may be off): a stop
        they did not answer in time."""
        import ray

        quiet, _, phase = ray.get(self.sink.quiet.remote())
        return diagnose(ranks, dump_stacks(ranks), quiet, stall_folder(self.run_dir, self.stalls), self.say,
                        silence=silence_in(phase))


MOVED_ON_S = 1.0
"""How long after a stuck-looking sample the stacks are taken again (a silence said slow or compiling, or before the first step)."""


def moved_on(ranks: list[RankProcess], stacks: list[str]) -> bool:
    """Whether any rank's training thread moved within MOVED_ON_S of `stacks`: a rank that moves is
    not stuck. Only that thread counts: Ray's own threads in a rank come and go between two looks."""
    time.sleep(MOVED_ON_S)
    return list(map(training_stack, dump_stacks(ranks))) != list(map(training_stack, stacks))


def restart_count(stalls: list[Report], restarts: int) -> str:
    """How many stalls the run has restarted from, of how many it may (the stall line's end)."""
    return f"stall {len(stalls)}; it restarts at most {restarts} failed worker groups"


def stall_folder(run_dir: Path, before: list[Report]) -> Path:
    """Where the next stall's stacks go: each stall keeps its own (stall/, stall-2/, ...)."""
    return run_dir / ("stall" if not before else f"stall-{len(before) + 1}")


def diagnose(ranks: list[RankProcess], stacks: list[str], quiet: float | None, folder: Path,
             say: Callable[[str], None], silence: str = STEP_SILENCE,
             workers: list[list[LoaderWorker]] | None = None) -> Report:
    """Write every rank's stack to `folder`/rankN.txt (its loader workers' to rankN-loader-workerI.txt),
    say where each is, end the ranks, and return the report that names the rank the others wait for
    (and, after it, any loader worker not waiting for work). `silence`: what did not happen for
    `quiet` seconds (a launched script has no steps: its stacks did not change). `workers`: the
    ranks' loader workers, where the caller took them already."""
    folder.mkdir(parents=True, exist_ok=True)
    places = []
    say(f"stalled: {silent_for(silence, quiet)}; every rank's stack -> {folder}")
    workers = dump_loader_workers(ranks) if workers is None else workers
    for rank, (where, text) in enumerate(zip(ranks, stacks)):
        (folder / f"rank{rank}.txt").write_text(text)
        place = read_place(text)
        places.append(place)
        waits = f"waits in {place.collective}" if place.collective else "waits in no collective"
        say(f"  {where.label()}: {place.frame}; {waits}")
        for i, worker in enumerate(workers[rank]):
            (folder / f"rank{rank}-loader-worker{i}.txt").write_text(worker.stack)
            say(f"    {worker_label(rank, i, worker)} {loader_place(worker.stack)}")
    end_ranks(ranks, workers)
    line = verdict(ranks, places, quiet, folder, silence)
    finding = loader_finding(stacks, workers)
    return Report(time.time(), quiet, culprit_ranks(places), f"{line}; {finding}" if finding else line, str(folder))
