"""What the parts of `raytrain launch` tell each other, as typed records: a rank's exit, why the
scripts must stop, the hub's events for the driver (an output line, a new attempt, an attempt's
end, the start-up marks) and the outcome the driver reads at the end.

Both sides import this module and Ray pickles the records between them, so it stays light: stdlib
only, no Ray, no torch.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

TEARDOWN_ABORT = "terminate called without an active exception"
"""What libstdc++ prints before SIGABRT when a running std::thread is destroyed: torch's (gloo's,
NCCL's) threads meeting the interpreter's teardown after a script's last line."""


@dataclass(frozen=True)
class ScriptError:
    """What torch's `@record` wrote to the TORCHELASTIC_ERROR_FILE when the script raised."""

    message: str
    """The exception, as torch's summary names it."""
    traceback: str
    """Its Python traceback; empty where torch wrote only a message."""


@dataclass(frozen=True)
class RankExit:
    """How one rank's script ended, as its agent tells the hub."""

    rank: int
    code: int
    """The script's returncode, as subprocess gives it: negative for a signal (-9: SIGKILL)."""
    hostname: str
    ip: str
    last_line: str
    """Its last non-blank line, stderr's before stdout's: what the driver's error line quotes."""
    error: ScriptError | None
    """The traceback torch's `@record` left, if the script raised."""
    ended_at: float
    """When it ended (time.time()): a dying rank takes its peers down within milliseconds, so the
    driver names the one that failed first by this, not by which agent spoke first."""
    aborted: bool
    """Stopped because a peer failed or the group resized: its code is no failure of its own."""
    ran: bool = True
    """Its script started: False for a rank stopped before it did."""
    raised: bool = False
    """Its script ended on an uncaught exception (torch's `@record` file, or a traceback last on its
    stderr), whatever its interpreter's teardown did after."""

    @property
    def failed(self) -> bool:
        """The script failed of its own accord."""
        return self.code != 0 and not self.aborted

    @property
    def _aborted_in_teardown(self) -> bool:
        return self.code == -signal.SIGABRT and self.last_line == TEARDOWN_ABORT

    @property
    def teardown_abort(self) -> bool:
        """SIGABRT right after libstdc++'s `terminate called without an active exception`, after a
        script that did not raise: how torch's threads can end an interpreter's teardown, after the
        script's last line."""
        return self._aborted_in_teardown and not self.raised

    @property
    def _raised_then_aborted(self) -> bool:
        """An uncaught exception, then that teardown abort: the exception is the script's end."""
        return self._aborted_in_teardown and self.raised

    @property
    def status(self) -> int:
        """The script's exit status, as a shell would report it: 1, as Python's, for an uncaught
        exception that torch's teardown then ended with SIGABRT (the abort is not the script's)."""
        return 1 if self._raised_then_aborted else exit_status(self.code)

    def describe(self) -> str:
        """`exited with status 3: <its last line>`, as the driver's lines say it; `raised <exception>`
        for a script whose teardown aborted after it raised, since the abort's line says nothing."""
        if self._raised_then_aborted and self.error and self.error.message:
            return f"raised {self.error.message}; torch's teardown then aborted it (SIGABRT)"
        return f"exited with {describe_exit(self.code)}" + (f": {self.last_line}" if self.last_line else "")


@dataclass(frozen=True)
class StopReason:
    """Why an attempt's scripts must stop, as the hub tells every agent. Made only by the three
    constructors below, so each cause has one signal, one wording and one grace."""

    cause: str
    """"signal" (the driver was signalled), "peer" (a peer's script failed) or "resize" (Ray Train
    is about to restart the group at another size)."""
    why: str
    """The reason in words, for the agent's error: `raytrain got SIGTERM`, `rank 1 failed`."""
    received: str | None = None
    """The signal the driver got, for a stop by signal."""
    kill: bool = False
    """SIGKILL at once, without the grace (a second Ctrl-C)."""

    @classmethod
    def signalled(cls, name: str, kill: bool = False) -> StopReason:
        """The driver got `name`: SIGINT goes on as SIGINT, SIGTERM and SIGUSR1 as SIGTERM."""
        return cls("signal", f"raytrain got {name}", received=name, kill=kill)

    @classmethod
    def peer_failed(cls, rank: int) -> StopReason:
        return cls("peer", f"rank {rank} failed")

    @classmethod
    def resizing(cls, why: str) -> StopReason:
        """`why`: what Ray Train's resize answers (a node lost or drained, room for more ranks)."""
        return cls("resize", why)

    @property
    def signal(self) -> str:
        """The signal each script gets."""
        return "SIGINT" if self.received == "SIGINT" else "SIGTERM"


@dataclass(frozen=True)
class OutputLine:
    """One line a rank's script wrote, on its way to the driver."""

    rank: int
    stream: str
    """"stdout" or "stderr": where the driver prints it, as the script wrote it."""
    text: str
    """The line without its newline; in-place updates (`\\r`) stay inside it."""


@dataclass(frozen=True)
class AttemptStarted:
    """Every rank of a new worker group met: the driver marks each log and, after the first
    attempt, says why the one before ended."""

    number: int
    """1 for the first attempt; restarts and resizes count on."""
    world_size: int
    previous: RankExit | None
    """The attempt before's rank whose script failed first, if one did."""
    resized: str | None
    """Why the attempt before was stopped for a resize, if it was."""


@dataclass(frozen=True)
class StartupMarks:
    """Rank 0's start-up marks (startup.py), sent once, as its first script starts."""

    marks: dict[str, float]
    """Stage name to time.time() at its end."""


@dataclass(frozen=True)
class AttemptEnded:
    """Every rank of an attempt reported how its script ended: the driver says which failed first
    (its traceback, the root cause) and which failed after it (knock-ons, one line each)."""

    number: int
    exits: dict[int, RankExit]
    failed_first: int | None
    excused: list[int]
    """Ranks whose teardown abort does not fail the attempt (Attempt.excused in launch/hub.py)."""
    signalled: bool
    """The driver was signalled: the ranks ended by its stop, which its own last line tells."""


HubEvent = OutputLine | AttemptStarted | AttemptEnded | StartupMarks
"""What the driver's main loop takes from the hub, in the order it happened."""


@dataclass(frozen=True)
class LaunchOutcome:
    """How the run ended, as the hub has it once fit() returned: the last attempt's ranks."""

    attempts: int
    """How many worker groups formed."""
    world_size: int | None
    """The last attempt's; None if no group ever formed."""
    exits: dict[int, RankExit]
    """The last attempt's exits, by rank; a rank whose agent never reported is missing."""
    failed_first: int | None
    """The last attempt's rank whose script failed first, if one did."""
    excused: list[int]
    """The last attempt's ranks whose teardown abort does not fail the run."""
    stop_signal: str | None
    """The signal the driver got first, if any."""
    peers: list[dict[str, Any] | None]
    """The last attempt's ranks as they joined the rendezvous (hostname, ip, ...), by rank."""


def describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def exit_status(code: int) -> int:
    """A child's returncode as a shell would report it: -9 (killed by SIGKILL) is 137."""
    return 128 - code if code < 0 else code
