"""Files that grow in place, in a directory that may be on an object store: launch's rank logs, a
sweep trial's log, TensorBoard's event files.

On a filesystem they are appended to where they are. An object cannot be appended to, so on an
object store they are written in a local temporary directory (a file begun with what an earlier
life of the run left there, as a file on disk would be) and copied up whole: by `keep`, which
callers run every KEEP_S while they write, and at `close`. What a process killed with SIGKILL (or
its node lost) loses is what it wrote since the last copy. The temporary directory goes at
`close`, or when the process exits; a store that refused the last copy leaves it, named.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TextIO

from raytrain_ddp.storage.behind import WriteBehind
from raytrain_ddp.storage.location import RunPath, first_line
from raytrain_ddp.storage.object_path import ObjectPath

QUIET_S = 30.0
"""How long a store may take no copy before it is said: longer than a blip, inside a minute."""
KEEP_S = 15.0
"""How often a changed file is copied up while it grows. Not on every line: each copy uploads the
whole file, so copying on launch's every poll (5 a second) would send each log again and again;
every 15 s costs a few requests a minute per file, and a quarter of the stall watch's default limit."""


def to_stderr(line: str) -> None:
    print(line, file=sys.__stderr__, flush=True)


class StagedDir:
    """The files of one directory, `where`: itself on a filesystem; a local copy on an object store."""

    def __init__(self, where: RunPath, say: Callable[[str], None] = to_stderr) -> None:
        self.say = say
        self.remote = where if isinstance(where, ObjectPath) else None
        if self.remote is None:
            self.local = Path(where)
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            self.local = Path(tempfile.mkdtemp(prefix=f"raytrain-{where.name}-"))
            atexit.register(self.remove)  # a process that ends before close()
            self.behind = WriteBehind(f"raytrain-copy-{where.name}")
        self.files: dict[str, TextIO] = {}
        self.copied: dict[str, tuple[int, int]] = {}
        """Each file's size and mtime at its last copy up: a file that has not changed is not sent again."""
        self.kept_at = time.monotonic()
        self.told_failing = False

    def open(self, name: str) -> TextIO:
        """`name`, opened for appending (once; later calls return the same file), with each line
        written through at once: a process that dies keeps it on local disk."""
        if name not in self.files:
            path = self.local / name
            if self.remote is not None and (self.remote / name).is_file():
                path.write_bytes((self.remote / name).read_bytes())  # a relaunch appends, as on disk
                self.copied[name] = self.mark(path)
            self.files[name] = open(path, "a", buffering=1, newline="")
        return self.files[name]

    def keep(self, every_s: float | None = None) -> None:
        """On an object store: copy each file that changed up whole, behind the caller, if `every_s`
        (KEEP_S) passed since the last copy. A store that fails the copies, or takes none for QUIET_S,
        is said once: that costs the copies, not the caller's work; they are tried again at each keep."""
        if self.remote is None or time.monotonic() - self.kept_at < (KEEP_S if every_s is None else every_s):
            return
        self.kept_at = time.monotonic()
        for f in self.files.values():
            f.flush()
        self.behind.offer(self.copy_up)
        quiet, error = self.behind.quiet()
        if error is not None and not isinstance(error, OSError):
            raise error  # ours, not the store's
        if not self.told_failing and (error is not None or quiet >= QUIET_S):
            self.told_failing = True
            why = first_line(error) if error is not None else f"no answer in {quiet:.0f} s"
            self.say(f"{self.remote} was not copied up ({why}); trying again every {KEEP_S:g} s")

    def sync(self) -> None:
        """On an object store: every file copied up now, before the caller goes on (a trial's log,
        before its outcome says it ended); a store that fails it is said."""
        if self.remote is None:
            return
        for f in self.files.values():
            f.flush()
        self.behind.offer(self.copy_up)
        try:
            self.behind.drain()
        except OSError as err:
            self.say(f"{self.remote} was not copied up ({first_line(err)})")

    def copy_up(self) -> None:
        """Each file that changed since its last copy, whole (on the WriteBehind's thread, or in drain)."""
        for path in sorted(self.local.iterdir()):
            if self.copied.get(path.name) != (mark := self.mark(path)):
                (self.remote / path.name).write_bytes(path.read_bytes())
                self.copied[path.name] = mark

    def close(self) -> None:
        """Close every file; on an object store, copy each up a last time and remove the local copies."""
        for f in self.files.values():
            f.flush()
        if self.remote is None:
            for f in self.files.values():
                f.close()
            return
        self.behind.offer(self.copy_up)
        try:
            copied, why = self.behind.close(give_up_s=QUIET_S), f"no answer in {QUIET_S:.0f} s"
        except OSError as err:
            copied, why = False, first_line(err)
        for f in self.files.values():
            f.close()
        if copied:
            self.remove()
        else:  # the local copies are all there is, so they stay
            atexit.unregister(self.remove)
            self.say(f"{self.remote} was not copied up ({why}): its files are kept in {self.local}")

    def remove(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)

    @staticmethod
    def mark(path: Path) -> tuple[int, int]:
        stat = path.stat()
        return stat.st_size, stat.st_mtime_ns
