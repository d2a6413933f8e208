"""What a launched script's output says, as text: its rank marks, its in-place (`\\r`) updates and
its last traceback. Pure functions on strings, used by the agent (the tail of a rank's stderr) and
the driver (the lines it prints); stdlib only.
"""

from __future__ import annotations

import re

from raytrain_ddp.launch.records import ScriptError

TRACEBACK = "Traceback (most recent call last):"
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
MOST_MESSAGE_LINES = 20
"""Lines of an exception's message kept after its `Name: text` line (a multi-line message)."""
_MARK = re.compile(r"^\[rank\d+\]: ?")
"""torch's own rank mark: once a process group exists, its excepthook puts `[rankN]: ` before each
line of a traceback, and its C++ warnings carry `[rankN]:`."""


def unmark(line: str) -> str:
    """The line without torch's `[rankN]: `, so the driver's mark is the only one."""
    return _MARK.sub("", line, count=1)


def mark(rank: int, text: str) -> str:
    """`[rankN]: ` before each line and each in-place update (`\\r`) of it, as torchrun's --tee does;
    not before the empty update of a line that starts with `\\r`."""
    prefix, parts = f"[rank{rank}]: ", text.split("\r")
    return "\r".join(prefix + unmark(part) if part or len(parts) == 1 else part for part in parts)


def settled(text: str) -> str:
    """What a terminal shows once a line's in-place updates are done: its last non-blank update.
    A log or a Slurm .out file gets this, not every update of a progress bar."""
    parts = [part for part in text.split("\r") if part.strip()]
    return parts[-1] if parts else ""


def _frames_end(lines: list[str], start: int) -> int:
    """After the frames (indented) of the traceback that starts at `start`: its `Name: message` line."""
    i = start + 1
    while i < len(lines) and lines[i].startswith(" "):
        i += 1
    return i


def _block_end(lines: list[str], start: int) -> int:
    """Where the traceback that starts at `start` ends: after its frames, its `Name: message` line
    and that message's further lines."""
    i = _frames_end(lines, start)
    end = i + 1
    while end < min(len(lines), i + 1 + MOST_MESSAGE_LINES) and lines[end].strip() and \
            not lines[end].startswith(("[", TRACEBACK, "terminate called ")) and lines[end] not in CHAINED:
        end += 1
    return min(end, len(lines))


_EXIT_NOISE = re.compile(r"^\[[WEIF]\d{4} |^terminate called |^\s*$")
"""What an interpreter's exit may print after an uncaught exception's traceback: torch's C++ log
lines (`[W1127 14:55:01.12 ... ProcessGroupNCCL.cpp:...] Warning: ...`), libstdc++'s `terminate
called ...` before a teardown abort, blank lines."""


def ended_on_traceback(lines: list[str]) -> bool:
    """Whether a rank's stderr ends on a Python traceback, with only exit noise after it: its script
    ended on an uncaught exception, whatever its teardown did next (a traceback it printed and
    went on from has the script's own lines after it)."""
    lines = [unmark(line.rstrip("\n")) for line in lines]
    starts = [i for i, line in enumerate(lines) if line == TRACEBACK]
    return bool(starts) and all(_EXIT_NOISE.match(line) for line in lines[_block_end(lines, starts[-1]):])


def last_traceback(lines: list[str]) -> ScriptError | None:
    """The last Python traceback in a rank's stderr (with the exceptions chained to it), as the
    script's own root cause, where torch's `@record` left none."""
    lines = [unmark(line.rstrip("\n")) for line in lines]
    starts = [i for i, line in enumerate(lines) if line == TRACEBACK]
    if not starts:
        return None
    first, end = starts[-1], _block_end(lines, starts[-1])
    for before in reversed(starts[:-1]):  # "During handling of the above exception": the whole chain
        between = [line for line in lines[_block_end(lines, before):first] if line.strip()]
        if len(between) != 1 or between[0] not in CHAINED:
            break
        first = before
    raised = _frames_end(lines, starts[-1])
    return ScriptError(lines[raised].strip() if raised < end else "", "\n".join(lines[first:end]))
