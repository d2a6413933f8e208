"""Every rank's whole output, <run dir>/logs/rank-N.log: appended in place on a filesystem. An object
cannot be appended to, so on an object store each log is written to a local temporary directory
(begun with what an earlier launch of the same name left there, as a file on disk would be) and
copied up whole: every KEEP_S seconds while the launch runs, and at its end. The directory goes
when the logs are closed (kept, and named, if the store refused the last copy), or when the driver exits."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, TextIO

from raytrain_ddp.storage.location import RunPath, first_line
from raytrain_ddp.storage.object_path import ObjectPath

KEEP_S = 15.0
"""How often a changed log is copied up to an object store: what a driver killed with SIGKILL (or
its node lost) can lose of the ranks' output. Not on every line: each copy uploads the whole file,
so copying on the driver's every poll (5 a second) would send each log again and again; every 15 s
costs a few requests a minute per rank, and a quarter of the stall watch's default limit."""


class RankLogs:
    """The open rank-N.log files of one launch, by rank."""

    def __init__(self, log_dir: RunPath, say: Callable[[str], None]) -> None:
        self.say = say
        self.remote = log_dir if isinstance(log_dir, ObjectPath) else None
        if self.remote is None:
            self.local = Path(log_dir)
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            self.local = Path(tempfile.mkdtemp(prefix="raytrain-launch-logs-"))
            atexit.register(self.remove)  # a driver that ends before close()
        self.files: dict[int, TextIO] = {}
        self.changed: set[int] = set()
        """The ranks whose log grew since it was last copied up."""
        self.kept_at = time.monotonic()
        self.told_failing = False

    def __getitem__(self, rank: int) -> TextIO:
        """Rank `rank`'s log, opened for appending on first use; a line written to it reaches the file
        at once (a driver that dies keeps it on disk)."""
        if rank not in self.files:
            path = self.local / f"rank-{rank}.log"
            if self.remote is not None and (self.remote / path.name).is_file():
                path.write_bytes((self.remote / path.name).read_bytes())  # a relaunch appends, as on disk
            self.files[rank] = open(path, "a", buffering=1, newline="")
        self.changed.add(rank)
        return self.files[rank]

    def write_all(self, text: str) -> None:
        for rank, f in self.files.items():
            f.write(text)
            self.changed.add(rank)

    def keep(self, now: bool = False) -> None:
        """On an object store: copy each changed log up whole, if KEEP_S passed since the last copy (or `now`)."""
        if self.remote is None or not self.changed or (not now and time.monotonic() - self.kept_at < KEEP_S):
            return
        self.kept_at = time.monotonic()
        for rank in sorted(self.changed):
            self.files[rank].flush()
            name = f"rank-{rank}.log"
            try:
                (self.remote / name).write_bytes((self.local / name).read_bytes())
            except OSError as err:  # a store that fails it costs the log's copy, not the launch: tried again later
                if not self.told_failing:
                    self.told_failing = True
                    self.say(f"the ranks' logs were not copied to {self.remote} ({first_line(err)}); "
                             f"trying again every {KEEP_S:g} s")
                return
        self.changed.clear()

    def close(self) -> None:
        """Close every log; on an object store, copy each up a last time and remove the local copies."""
        self.keep(now=True)
        for f in self.files.values():
            f.close()
        if self.remote is None:
            return
        if self.changed:  # the last copy failed too: the local copies are all there is, so they stay
            atexit.unregister(self.remove)
            self.say(f"the ranks' logs were not copied to {self.remote}: they are kept in {self.local}")
        else:
            self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
