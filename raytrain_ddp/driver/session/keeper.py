"""The keeper of a private Ray: a small process the driver spawns first, which starts the Ray head
(`ray start --head --block`) as its child and ends every process of it when the driver goes.

It makes itself a child subreaper, so each Ray process, however deep (the agents, the workers),
stays its descendant, and an orphan is reparented to it, not to init. The driver's end is seen two
ways the kernel gives: EOF on a pipe whose only writer is the driver (any death, SIGKILL included,
closes it), and PR_SET_PDEATHSIG. It also watches the head: when the GCS, the raylet or `ray start`
dies, it writes one line naming the part to `lost` in its directory, then ends the rest.

Run by file path (`python keeper.py ...`), not as a package module: stdlib only, so it is up in tens
of milliseconds, beside the driver's own imports.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
WATCH_S = 0.25
"""How often the head's processes are looked at."""
GRACE_S = 2.0
"""Between SIGTERM to every descendant and SIGKILL to those left."""
REPORT_WAIT_S = 5.0
"""How long `ray start`, which looks at its children each second, gets to say how one died (longer on
a busy machine; it exits as soon as it has said)."""
CORE = ("gcs_server", "raylet")
"""The head's processes whose death ends the cluster (their /proc comm)."""
LOST = "lost"
"""The file, in the keeper's directory, that says which part of the head died."""
DYING = "dying"
"""The file, in the keeper's directory, made as soon as a part of the head is seen gone, before
`ray start` has said how (LOST follows within REPORT_WAIT_S)."""
ENDED = "ended"
"""The file, in the keeper's directory, made once every process of its head is gone: the directory
is then only logs, and a later keeper may remove it (prune)."""
KEEP_ENDED = 10
"""How many ended private Rays' directories a keeper leaves at its end, the newest (its own among
them): the logs of the latest runs stay for a look, and a user's temp dir does not fill with one
directory per run."""
DIED_LINE = re.compile(r"(?:^|\s)(\w+) \[exit code=(-?\d+)")
"""`ray start --block`'s line for a child that died (ray/scripts/scripts.py), once its colours are
taken out: `... ERR scripts.py:87 -- raylet [exit code=-9]`."""
COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def processes() -> dict[int, tuple[int, str, str]]:
    """Every process now: pid -> (parent pid, comm, state), from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (seen := process(int(entry))) is not None:
            found[int(entry)] = seen
    return found


def process(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, comm, state) of `pid`, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # gone meanwhile
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
    return int(ppid), comm, state


def parent(pid: int) -> int | None:
    seen = process(pid)
    return seen[0] if seen is not None else None


def descendants(root: int) -> dict[int, str]:
    """Every live (not zombie) descendant of `root`: pid -> comm."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        _, comm, state = table[pid]
        if state != "Z":
            out[pid] = comm
        todo += children.get(pid, [])
    return out


def reap(statuses: dict[int, int]) -> None:
    """Collect every child that has ended (our own, and orphans handed to us), with its wait status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = status


def how(status: int) -> str:
    """A wait status, in words: `was killed by SIGKILL`, `exited with status 1`."""
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def exit_code_words(code: int) -> str:
    """`ray start`'s exit code of a child (negative: a signal), in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def reported_deaths(log_text: str) -> dict[str, str]:
    """What `ray start --block` said of each child that died: process type -> how, in words."""
    found = {}
    for line in COLOURS.sub("", log_text).splitlines():
        if m := DIED_LINE.search(line):
            found[m.group(1)] = exit_code_words(int(m.group(2)))
    return found


def loss_line(name: str, pid: int, words: str | None) -> str:
    part = "head `ray start`" if name == "ray" else name
    return f"the private Ray's {part} (pid {pid}) {words or 'ended'}"


def end_tree(statuses: dict[int, int]) -> None:
    """SIGTERM to every descendant, then SIGKILL to each left once the raylet is gone or GRACE_S has
    passed, until none is left, all reaped. Ray's workers end with their raylet, so nothing left has
    work to finish: the GCS (a private head's keeps nothing on disk), `ray start`'s wait and the
    autoscaler's monitor. Those sat out the whole grace: 2 s of every private Ray's end."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        for pid in descendants(os.getpid()):
            kill_quietly(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap(statuses)
            left = descendants(os.getpid())
            if not left:
                return
            if sig == signal.SIGKILL:  # one forked meanwhile
                for pid in left:
                    kill_quietly(pid, signal.SIGKILL)
            elif "raylet" not in left.values():
                break
            time.sleep(0.05)


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # ended meanwhile
        pass


def keep(watch_fd: int, directory: Path, head_cmd: list[str]) -> int:
    """Start the head and watch it and the driver; end every process of it when either goes. Exit
    status 1 when the head died first."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle; it stops us after
    log = (directory / "ray-start.log").open("ab")
    # Should the keeper itself be SIGKILLed, `ray start` goes too, and Ray's own fate-sharing takes its
    # GCS and raylet with it (preexec_fn is safe here: the keeper runs no threads).
    head = subprocess.Popen(head_cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    statuses: dict[int, int] = {}
    core: dict[int, str] = {}
    lost = None
    while not stopping:
        readable, _, _ = select.select([watch_fd], [], [], WATCH_S)
        if readable and not os.read(watch_fd, 64):
            break  # EOF: the driver ended (or closed its end to stop us)
        reap(statuses)
        alive = descendants(os.getpid())
        gone = [pid for pid in core if pid not in alive]
        if head.pid in statuses or gone:
            (directory / DYING).touch()
            lost = describe(head, statuses, core, gone, directory)
            break
        # The core are `ray start`'s own children: a worker the raylet forks bears the raylet's name
        # until it execs, and one taken for the raylet then ended the head when the worker exited
        # (seen in a sweep on a busy 2-core machine: "the private Ray's raylet (pid 11632) ended").
        core |= {pid: comm for pid, comm in alive.items() if comm in CORE and pid not in core
                 and parent(pid) == head.pid}
    if lost:  # said before the rest is ended, so the driver can say it at once
        tmp = directory / f"{LOST}.tmp"
        tmp.write_text(lost + "\n")
        tmp.replace(directory / LOST)
    end_tree(statuses)
    try:
        (directory / "token").unlink()
    except FileNotFoundError:
        pass
    try:
        (directory / ENDED).touch()
        prune(directory.parent)
    except OSError:  # the logs stay; nothing of the run depends on their removal
        pass
    return 1 if lost else 0


def prune(base: Path, keep: int = KEEP_ENDED) -> None:
    """Remove all but the newest `keep` ended directories under `base`; a head that runs has no
    ENDED file, and one whose keeper was killed keeps its directory."""
    ended = []
    for directory in base.iterdir():
        try:
            ended.append(((directory / ENDED).stat().st_mtime, directory))
        except OSError:  # not ended, or not a directory
            continue
    for _, directory in sorted(ended, reverse=True)[keep:]:
        shutil.rmtree(directory, ignore_errors=True)


def describe(head: subprocess.Popen, statuses: dict[int, int], core: dict[int, str], gone: list[int],
             directory: Path) -> str:
    """The line that names the part of the head that died, and how, as far as can be told."""
    if head.pid in statuses and os.WIFSIGNALED(statuses[head.pid]):
        return loss_line("ray", head.pid, how(statuses[head.pid]))
    deadline = time.monotonic() + REPORT_WAIT_S
    while head.pid not in statuses and time.monotonic() < deadline:  # `ray start` reports, then exits
        time.sleep(0.05)
        reap(statuses)
    said = reported_deaths((directory / "ray-start.log").read_text(errors="replace"))
    if gone:
        pid = culprit(core, gone, said)
        return loss_line(core[pid], pid, how(statuses[pid]) if pid in statuses else said.get(core[pid]))
    if said:
        name, words = next(iter(said.items()))
        return f"the private Ray's {name} {words}"
    return loss_line("ray", head.pid, how(statuses[head.pid]) if head.pid in statuses else None)


def culprit(core: dict[int, str], gone: list[int], said: dict[str, str]) -> int:
    """Which of the head's processes `gone` at one look died first: the one `ray start` saw die, not
    those it then ended itself (a busy machine looks late, and finds them all gone)."""
    return next((pid for name in said for pid in gone if core[pid] == name), gone[0])


def main(argv: list[str]) -> int:
    """argv: the driver's pid, the watch pipe's fd, 1 to take PR_SET_PDEATHSIG, the keeper's
    directory, then the `ray start` command."""
    driver, watch_fd, pdeathsig, directory = int(argv[0]), int(argv[1]), argv[2] == "1", Path(argv[3])
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if pdeathsig:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != driver:  # the driver died before the line above: no signal would come
            return 0
    return keep(watch_fd, directory, argv[4:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
