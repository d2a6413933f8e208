"""Writes to an object store behind the caller, on a thread of their own.

A store that stops answering holds a request for up to REQUEST_S, and pyarrow tries it 3 times: a
driver that wrote the run's files in its poll stopped printing, watching for stalls and passing on
Ctrl-C for minutes at a time. So the poll hands each write to a WriteBehind and goes on. Each write
is whole (the newest state of the files it writes), so one offered while another runs replaces any
not yet begun: a store that comes back gets the newest state, once. The poll asks `quiet()` how long
the store has taken no write, and says so.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class WriteBehind:
    """One thread that runs the newest write offered to it."""

    def __init__(self, name: str) -> None:
        self.changed = threading.Condition()
        self.next: Callable[[], None] | None = None
        """The write to run next; None when there is none."""
        self.running = False
        self.since: float | None = None
        """When the store last stopped taking writes: the start of the write in flight, or of the first
        of the failures in a row; None while it takes them."""
        self.error: Exception | None = None
        """The last write's error; None after one that succeeded."""
        self.closed = False
        self.thread = threading.Thread(target=self.serve, name=name, daemon=True)
        self.thread.start()

    def offer(self, write: Callable[[], None]) -> None:
        """Run `write` next, in place of any offered write not yet begun."""
        with self.changed:
            self.next = write
            self.changed.notify_all()

    def quiet(self) -> tuple[float, Exception | None]:
        """Seconds the store has taken no write (0 while it takes them), and the last write's error."""
        with self.changed:
            return (0.0 if self.since is None else time.monotonic() - self.since), self.error

    def drain(self) -> None:
        """Wait for the write in flight (its requests are bounded: location.REQUEST_S), then run the
        newest one offered, here: the caller goes on once it is done, and learns its error (raised)."""
        with self.changed:
            while self.running:
                self.changed.wait()
            write, self.next = self.next, None
        if write is None:
            return
        write()
        with self.changed:
            self.since, self.error = None, None

    def close(self, give_up_s: float) -> bool:
        """Wait until the newest write offered is done, and end the thread; False, at once, when the
        store has taken no write for `give_up_s` (a request in flight may wait minutes more: the
        thread is left to it). The last write's error is raised."""
        with self.changed:
            while self.running or self.next is not None:
                quiet = 0.0 if self.since is None else time.monotonic() - self.since
                if quiet >= give_up_s:
                    return False
                self.changed.wait(give_up_s - quiet)
            self.closed = True
            self.changed.notify_all()
            if self.error is not None:
                raise self.error
            return True

    def serve(self) -> None:
        while True:
            with self.changed:
                while self.next is None and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                write, self.next, self.running = self.next, None, True
                began = time.monotonic()
                self.since = self.since or began
            try:
                write()
                error = None
            except Exception as err:  # said by the poll that reads quiet(), not lost with this thread
                error = err
            with self.changed:
                self.running, self.error = False, error
                if error is None:
                    self.since = None
                self.changed.notify_all()
