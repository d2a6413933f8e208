"""One driver per run directory: a kernel lock on <run dir>/driver.lock, held for the driver's life;
on an object store, which has no locks, a lease in that object, renewed while the driver lives.

A second `raytrain run` (or `launch`) on a --name that a live driver holds is refused in one line
that names the holder, before it moves, writes or starts anything. The kernel drops the lock when
its holder dies, however it dies (SIGKILL, a node's OOM killer, a Slurm requeue of the same job),
so a stale lock never blocks a rerun and there is no pid file to judge.

The lock is flock(2) on an open file description: not passed to the processes the driver starts
(Python opens files non-inheritable, and Ray's processes are exec'd), so an orphaned Ray process
cannot keep it. On NFS, Linux turns flock into a byte-range lock that the server keeps, so drivers
on different nodes see each other's; docs/troubleshooting.md says what that costs after a crash.

The lease (an object store's run): the driver writes its Holder, waits CONFIRM_S, and reads it back;
only a driver that reads its own holds the run, and a thread renews it every RENEW_S. A lease not
renewed for LEASE_S is a dead driver's, and is taken over; so is one of the same Slurm job (a
requeue: Slurm ended the old driver first) or of a process that is gone from this host. Two
drivers that write within the same CONFIRM_S both read the later one's: one holds it, the other
is refused. A store gives no stronger lock through pyarrow (no conditional write).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_ddp.config import ConfigError
from raytrain_ddp.storage.location import RunPath, first_line
from raytrain_ddp.storage.object_path import ObjectPath

LOCK = "driver.lock"
"""In the run directory: locked by the live driver, and holding its Holder as JSON."""
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
"""What flock says on a filesystem without locks (a Lustre mounted without -o flock, some NFS mounts)."""

LEASE_S = 60.0
"""An object store's lease not renewed for this long is a dead driver's: the next driver takes it."""
RENEW_S = 10.0
"""How often the live driver renews its lease."""
CONFIRM_S = 1.0
"""How long a driver waits, after writing its lease, before it reads it back to see that it holds it."""
END_S = 2.0
"""How long a driver's end waits to give its lease up; past that, the lease lapses by itself (LEASE_S)."""

held: dict[RunPath, Any] = {}
"""This process's locks: run directory -> the open file that holds its lock (a Lease on an object
store). A second take() of the same directory (the Python API's second run, `raytrain scale`) is no
conflict with itself."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: what the refused driver's line names."""

    host: str
    pid: int
    since: float
    """time.time() when it took the lock."""
    command: str
    renewed: float = 0.0
    """time.time() of its lease's last renewal (object stores only)."""
    job: str = ""
    """Its Slurm job, if any: a requeued job's new driver takes over its old one's lease."""

    def line(self, run_dir: RunPath) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        lapses = (f"; its lease lapses {LEASE_S:.0f} s after its last renewal, {time.time() - self.renewed:.0f} s ago"
                  if self.renewed else "")
        return (
            f"run {run_dir.name!r} is in use by another driver: pid {self.pid} on {self.host}, since {when} "
            f"({self.command}){lapses}; wait for it to end or stop it, or pass a new --name"
        )


def take(run_dir: RunPath) -> None:
    """Lock `run_dir` (made if missing) for this process until it exits or release() is called;
    a ConfigError naming the holder when another live driver has it."""
    if isinstance(run_dir, ObjectPath):
        if run_dir in held:
            held[run_dir].write()  # held: again, where a move aside (--no-resume) took it along
        else:
            held[run_dir] = Lease.take(run_dir)
        return
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


def release(run_dir: RunPath) -> None:
    """Let another driver have `run_dir` (the Python API's run() ended); a no-op when not held."""
    lock = held.pop(run_dir, None)
    if isinstance(lock, Lease):
        lock.end()
    elif lock is not None:
        os.close(lock)


class Lease:
    """This driver's lease on an object store's run directory, renewed on a thread of its own."""

    def __init__(self, path: ObjectPath, me: Holder) -> None:
        self.path, self.me = path, me
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.renew, name="raytrain-lease", daemon=True)
        self.thread.start()

    @classmethod
    def take(cls, run_dir: ObjectPath) -> Lease:
        path = run_dir / LOCK
        if (other := read_holder(path)) is not None and live(other):
            raise ConfigError(other.line(run_dir))
        now = time.time()
        me = Holder(socket.gethostname(), os.getpid(), now, command()[:200], renewed=now,
                    job=os.environ.get("SLURM_JOB_ID", ""))
        try:
            path.write_text(json.dumps(asdict(me)))
        except OSError as err:
            raise ConfigError(f"cannot write run directory {run_dir} ({first_line(err)}); "
                              "pass a writable --storage-path") from None
        time.sleep(CONFIRM_S)
        back = read_holder(path)
        if back != me:
            raise ConfigError(back.line(run_dir) if back is not None else
                              f"run {run_dir.name!r}: another driver took its lease as this one did; pass a new --name")
        return cls(path, me)

    def renew(self) -> None:
        while not self.done.wait(RENEW_S):
            try:
                self.write()
            except OSError as err:  # the store away for a while: the next renewal tries again
                print(f"warning: cannot renew the lease {self.path} ({first_line(err)})", file=sys.stderr)

    def write(self) -> None:
        self.me = Holder(**{**asdict(self.me), "renewed": time.time()})
        self.path.write_text(json.dumps(asdict(self.me)))

    def end(self) -> None:
        """Stop renewing, and give the lease up, waiting at most END_S: where the store does not answer
        (a request waits up to 60 s, tried 3 times), it lapses by itself (LEASE_S), and the command's own
        error, not this one, is what the user reads."""
        self.done.set()
        ending = threading.Thread(target=self.give_up, name="raytrain-lease-end", daemon=True)
        ending.start()
        ending.join(END_S)

    def give_up(self) -> None:
        self.thread.join()
        try:
            if read_holder(self.path) == self.me:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass


def read_holder(path: ObjectPath) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # not one of ours whole: no holder to respect
        return None


def live(holder: Holder) -> bool:
    """Whether `holder`'s lease still holds: renewed within LEASE_S, by neither a Slurm job that is
    this one (requeued) nor a process gone from this host."""
    if time.time() - holder.renewed > LEASE_S:
        return False
    if holder.job and holder.job == os.environ.get("SLURM_JOB_ID"):
        return False
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's live process
            pass
    return True


def made_by(path: RunPath) -> RunPath | None:
    """The topmost of `path` and its parents that does not exist yet: what making `path` would make.
    None on an object store, which makes no directories."""
    if isinstance(path, ObjectPath):
        return None
    made = None
    for p in (path, *path.parents):
        if p.exists():
            break
        made = p
    return made


def abandon(run_dir: RunPath, made: RunPath | None) -> None:
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


def holder_line(run_dir: RunPath) -> str:
    """The refusal: who holds the lock, from what it wrote there. It writes just after it locks, so
    an empty file is one that is a moment old: read again before saying less."""
    for _ in range(10):
        try:
            holder = Holder(**json.loads((run_dir / LOCK).read_text()))
            return holder.line(run_dir)
        except (OSError, ValueError, TypeError):
            time.sleep(0.1)
    return f"run {run_dir.name!r} is in use by another driver (see {run_dir / LOCK}); wait for it to end, or pass a new --name"
