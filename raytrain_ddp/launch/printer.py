"""What a `raytrain launch` shows: every shown rank's lines, marked with its rank, each rank's whole
output in logs/, a failure's root cause once and its knock-ons in a line each, and raytrain's own
lines on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any

from raytrain_ddp.driver.core.drive import StartupClock
from raytrain_ddp.launch.output import TRACEBACK, mark, settled, unmark
from raytrain_ddp.launch.records import (
    TEARDOWN_ABORT, AttemptEnded, AttemptStarted, OutputLine, RankExit, StartupMarks, describe_exit,
)
from raytrain_ddp.storage.location import RunPath
from raytrain_ddp.storage.staged import StagedDir

HOLD_S = 5.0
"""How long a shown rank's traceback is held back from the terminal, waiting for its rank's exit to
tell a root cause (shown whole, once) from a knock-on (one line); a script that lives on after it
printed a traceback gets it shown after this."""


MOST_KNOCK_ONS = 3
"""Knock-on failures named one line each; more are counted."""


QUOTE_CHARS = 200
"""A knock-on's quoted message is cut here, to stay one line."""


def root_cause(failed: RankExit) -> None:
    """The failing rank's traceback, as torchrun's summary shows it: the one its torch `@record` left
    in its TORCHELASTIC_ERROR_FILE, else the last one it printed."""
    error = failed.error
    if error and error.traceback:
        say(f"root cause: rank {failed.rank} on {failed.hostname} raised {error.message}")
        print(error.traceback.rstrip("\n"), file=sys.stderr, flush=True)


def tell_end(exits: dict[int, RankExit], first: int | None, excused: list[int]) -> None:
    """How an attempt's ranks ended, beyond its exit status: the root cause's traceback, then each
    rank that failed after it in one line (a knock-on: a peer gone from its collective), and each
    teardown abort that fails nothing."""
    if first is not None:
        root_cause(exits[first])
        after = sorted((e.ended_at, r) for r, e in exits.items() if r != first and e.code != 0 and e.ran)
        for _, rank in after[:MOST_KNOCK_ONS]:
            end = exits[rank]
            said = end.error.message if end.error and end.error.message else end.last_line
            said = said if len(said) <= QUOTE_CHARS else said[:QUOTE_CHARS] + " ..."
            why = f"stopped because rank {first} failed" if end.aborted else f"a knock-on of rank {first}'s failure"
            say(f"rank {rank} exited with {describe_exit(end.code)} {end.ended_at - exits[first].ended_at:.1f} s "
                f"later, {why}" + (f": {said}" if said else ""))
        if len(after) > MOST_KNOCK_ONS:
            say(f"{len(after) - MOST_KNOCK_ONS} more ranks failed after rank {first}; every rank's output is in logs/")
    for rank in excused:
        end = exits[rank]
        say(f"rank {rank} on {end.hostname} ended with signal SIGABRT after its script's last line "
            f"({TEARDOWN_ABORT!r}) while every other rank exited 0: that looks like torch's interpreter "
            "teardown, not a training failure, so it fails nothing; dist.destroy_process_group() at the "
            "script's end usually avoids it")


def say(line: str) -> None:
    """raytrain's own lines go to stderr, so the script's stdout stays the script's."""
    print(f"raytrain: {line}" if not line.startswith("error: ") else line, file=sys.stderr, flush=True)


class Printer:
    """The ranks' lines, fetched by the driver's main loop while fit() runs: every line to
    logs/rank-N.log, the shown ranks' lines to this terminal (stdout or stderr, as the script wrote
    them), marked `[rankN]:` as torchrun's --tee marks them; and, when the first script starts, the
    start-up stages.

    A shown rank's traceback waits (HOLD_S) for how the attempt ended: the rank that failed first
    gets it shown as the root cause, a rank that failed after it one line, as a knock-on."""

    def __init__(self, hub: Any, log_dir: RunPath, shown: set[int], clock: StartupClock):
        self.hub, self.shown, self.clock = hub, shown, clock
        self.logs = StagedDir(log_dir, say)
        """Every rank's whole output, logs/rank-N.log (copied up every KEEP_S on an object store)."""
        self.held: dict[int, list[OutputLine]] = {}
        """A shown rank's stderr lines from its last traceback on, by rank."""
        self.held_since: dict[int, float] = {}
        self.told: set[int] = set()
        """The attempts whose end (root cause, knock-ons) was said."""
        # A terminal redraws a `\r` update in place; a file (a Slurm .out) would keep every one.
        self.tty = {"stdout": sys.stdout.isatty(), "stderr": sys.stderr.isatty()}

    def drain(self) -> None:
        import ray

        for event in ray.get(self.hub.take_events.remote()):
            if isinstance(event, StartupMarks):  # rank 0's agent marks (the first attempt's), stitched to ours
                if line := self.clock.ranks_started(event.marks):
                    say(line)
            elif isinstance(event, AttemptStarted):
                self.new_attempt(event)
            elif isinstance(event, AttemptEnded):
                self.attempt_ended(event)
            else:
                self.logs.open(f"rank-{event.rank}.log").write(event.text + "\n")
                if event.rank in self.held and event.stream == "stderr":  # its traceback goes on
                    self.held[event.rank].append(event)
                elif event.rank in self.shown and event.stream == "stderr" and unmark(event.text) == TRACEBACK:
                    self.held[event.rank], self.held_since[event.rank] = [event], time.monotonic()
                elif event.rank in self.shown:
                    self.show(event)
        for rank in [r for r, since in self.held_since.items() if time.monotonic() - since > HOLD_S]:
            self.release(rank)
        self.logs.keep()

    def show(self, line: OutputLine) -> None:
        text = line.text if self.tty[line.stream] else settled(line.text)
        print(mark(line.rank, text), file=sys.stdout if line.stream == "stdout" else sys.stderr, flush=True)

    def release(self, rank: int, drop: bool = False) -> None:
        """A held traceback: to the terminal as it was, or dropped where the attempt's end says it."""
        lines = self.held.pop(rank, [])
        self.held_since.pop(rank, None)
        for line in [] if drop else lines:
            self.show(line)

    def attempt_ended(self, ended: AttemptEnded) -> None:
        """Every rank of an attempt exited: its root cause and knock-ons, in place of their tracebacks."""
        first = None if ended.signalled else ended.failed_first
        for rank in list(self.held):
            end = ended.exits.get(rank)
            said = end is not None and end.code != 0 and (rank != first or bool(end.error and end.error.traceback))
            self.release(rank, drop=first is not None and said)
        if not ended.signalled:
            tell_end(ended.exits, first, ended.excused)
            self.told.add(ended.number)

    def new_attempt(self, attempt: AttemptStarted) -> None:
        """A new worker group: marked in every log; on the terminal, why the last one ended."""
        for rank in list(self.held):
            self.release(rank)
        for log in self.logs.files.values():  # the ranks that wrote so far; a rank's first line opens its log
            log.write(f"--- attempt {attempt.number}, world size {attempt.world_size} ---\n")
        if attempt.number == 1:
            return
        failed = attempt.previous
        if failed is not None:  # a script failed first: that is the cause, whatever came after
            if attempt.number - 1 not in self.told:
                root_cause(failed)
            say(f"attempt {attempt.number - 1}: rank {failed.rank} on {failed.hostname} {failed.describe()}")
        elif attempt.resized:
            say(f"attempt {attempt.number - 1}: every rank got SIGTERM because {attempt.resized}")
        say(f"attempt {attempt.number}: the worker group restarted at world size {attempt.world_size} "
            f"(TORCHELASTIC_RESTART_COUNT={attempt.number - 1}); the script runs again")

    def close(self) -> None:
        self.drain()  # the last lines may have landed after the previous poll
        for rank in list(self.held):
            self.release(rank)
        self.logs.close()
