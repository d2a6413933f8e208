"""One driver per run directory: a kernel lock on <run dir>/driver.lock, held for the driver's life.

A second `raytrain run` (or `launch`) on a --name that a live driver holds is refused in one line
that names the holder, before it moves, writes or starts anything. The kernel drops the lock when
its holder dies, however it dies (SIGKILL, a node's OOM killer, a Slurm requeue of the same job),
so a stale lock never blocks a rerun and there is no pid file to judge.

The lock is flock(2) on an open file description: not passed to the processes the driver starts
(Python opens files non-inheritable, and Ray's processes are exec'd), so an orphaned Ray process
cannot keep it. On NFS, Linux turns flock into a byte-range lock that the server keeps, so drivers
on different nodes see each other's; docs/troubleshooting.md says what that costs after a crash.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from raytrain_ddp.config import ConfigError

LOCK = "driver.lock"
"""In the run directory: locked by the live driver, and holding its Holder as JSON."""
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
"""What flock says on a filesystem without locks (a Lustre mounted without -o flock, some NFS mounts)."""

held: dict[Path, int] = {}
"""This process's locks: run directory -> the open file that holds its lock. A second take() of the
same directory (the Python API's second run, `raytrain scale`) is no conflict with itself."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: what the refused driver's line names."""

    host: str
    pid: int
    since: float
    """time.time() when it took the lock."""
    command: str

    def line(self, run_dir: Path) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (
            f"run {run_dir.name!r} is in use by another driver: pid {self.pid} on {self.host}, since {when} "
            f"({self.command}); wait for it to end or stop it, or pass a new --name"
        )


def take(run_dir: Path) -> None:
    """Lock `run_dir` (made if missing) for this process until it exits or release() is called;
    a ConfigError naming the holder when another live driver has it."""
    if run_dir in held and same_file(held[run_dir], run_dir / LOCK):
        return
    release(run_dir)  # held, but its directory was moved aside (--no-resume): lock the new one
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"cannot write run directory {run_dir} ({err.strerror}); pass a writable --storage-path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in NO_LOCKS:
            print(f"warning: cannot lock {run_dir / LOCK} ({err.strerror}): a second driver on this --name "
                  "would not be refused", file=sys.stderr)
            return
        raise ConfigError(holder_line(run_dir)) from None
    if not same_file(fd, run_dir / LOCK):  # a refused driver removed it after we opened it (abandon): again
        os.close(fd)
        return take(run_dir)
    me = Holder(socket.gethostname(), os.getpid(), time.time(), command()[:200])
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
    held[run_dir] = fd


def release(run_dir: Path) -> None:
    """Let another driver have `run_dir` (the Python API's run() ended); a no-op when not held."""
    fd = held.pop(run_dir, None)
    if fd is not None:
        os.close(fd)


def made_by(path: Path) -> Path | None:
    """The topmost of `path` and its parents that does not exist yet: what making `path` would make."""
    made = None
    for p in (path, *path.parents):
        if p.exists():
            break
        made = p
    return made


def abandon(run_dir: Path, made: Path | None) -> None:
    """A refused command's release: when it made `run_dir` (`made`, from made_by() before take()), the
    directory goes too, with the parents made for it, so a refusal leaves nothing behind; whatever
    else is in them by then stays."""
    fd = held.get(run_dir)
    if made is not None and fd is not None and same_file(fd, run_dir / LOCK):
        (run_dir / LOCK).unlink()  # while it is locked: a driver that opened it meanwhile sees it gone (take)
    release(run_dir)
    if made is None:
        return
    for p in (run_dir, *run_dir.parents):
        try:
            p.rmdir()
        except OSError:  # not empty: another driver's, or the user's, by now
            return
        if p == made:
            return


def command() -> str:
    """This process's command line, as the user typed it: `raytrain ...`, or the Python API's script."""
    cli = Path(sys.argv[0]).name == "raytrain" or sys.argv[0].endswith("raytrain_ddp/__main__.py")
    return shlex.join(["raytrain", *sys.argv[1:]] if cli else ["python", *sys.argv])


def same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def holder_line(run_dir: Path) -> str:
    """The refusal: who holds the lock, from what it wrote there. It writes just after it locks, so
    an empty file is one that is a moment old: read again before saying less."""
    for _ in range(10):
        try:
            holder = Holder(**json.loads((run_dir / LOCK).read_text()))
            return holder.line(run_dir)
        except (OSError, ValueError, TypeError):
            time.sleep(0.1)
    return f"run {run_dir.name!r} is in use by another driver (see {run_dir / LOCK}); wait for it to end, or pass a new --name"
