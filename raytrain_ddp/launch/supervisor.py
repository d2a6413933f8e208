"""One rank's script as a supervised child process, as torchrun's agent hands its workers to one
process context: spawned with what a script under torchrun can count on, its output collected line
by line, signalled once and SIGKILLed after the grace, and torch's error file read when it ended.

It knows nothing of Ray or of the hub: the agent (agent.py) tells it when to stop, and where its
lines go.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from raytrain_ddp.launch.output import ended_on_traceback, last_traceback, settled, unmark
from raytrain_ddp.launch.records import ScriptError, StopReason

PEER_FAILED_GRACE_S = 10.0
"""After a peer failed: seconds between SIGTERM and SIGKILL, so no rank waits out a collective."""
PR_SET_PDEATHSIG = 1
SIG_SETMASK = 2
_libc = ctypes.CDLL(None, use_errno=True)
_prctl, _signal, _sigmask = _libc.prctl, _libc.signal, _libc.pthread_sigmask  # loaded before any fork: see _as_torchrun_child
_EMPTY_SIGSET = ctypes.create_string_buffer(128)  # a sigset_t with no signal in it
TAIL_LINES = 400
"""The last lines of its stderr kept, for the traceback of a script that raised without `@record`."""


def _as_torchrun_child() -> None:
    """In the child, before exec: SIGKILL when the agent's thread dies, so no script outlives its Ray
    worker; and the signals a script under torchrun can count on. A Ray worker ignores SIGINT and
    its threads may block signals, and both would pass to the script through exec: Ctrl-C would
    never reach it, nor a SIGTERM while it is blocked."""
    # Only calls through already loaded pointers: between fork and exec, in a process full of
    # threads, loading a library could wait forever on a lock another thread held.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _sigmask(SIG_SETMASK, _EMPTY_SIGSET, None)
    for sig in (signal.SIGINT, signal.SIGTERM):
        _signal(sig, 0)  # SIG_DFL: Python then installs its own KeyboardInterrupt handler


def spawn(argv: list[str], cwd: str, env: dict[str, str]) -> subprocess.Popen:
    """`python ARGV` in its own session, so a stop reaches only it and a kill takes its children too."""
    return subprocess.Popen(
        [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_as_torchrun_child,
    )


def read_error_file(path: str) -> ScriptError | None:
    """What torch's @record wrote when the script raised: its message and traceback."""
    try:
        with open(path) as f:
            data = json.load(f)["message"]
        if isinstance(data, str):
            return ScriptError(data, "")
        return ScriptError(data["message"], data.get("extraInfo", {}).get("py_callstack", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Stopper:
    """Signals one script once, then SIGKILLs its process group if it is still there after the grace.

    The agent learns of a stop from the hub the moment it is asked for (a waiting call, not a poll),
    so every rank gets the signal within milliseconds of the others: a rank must not learn of the
    stop from its peers' collectives first, exit 0, and then be signalled again while its
    interpreter tears down (its handlers gone), which would kill a clean exit.
    """

    def __init__(self, child: subprocess.Popen, grace_s: float) -> None:
        self.child, self.grace_s = child, grace_s
        self.reason: StopReason | None = None
        self.kill_at: float | None = None
        self.lock = threading.Lock()

    def stop(self, reason: StopReason) -> None:
        with self.lock:
            if self.child.poll() is not None:
                return  # it ended on its own: nothing to stop, and no signal to kill a clean exit with
            if reason.kill:
                self.reason = self.reason or reason
                self._kill()
                return
            if self.reason is not None:
                return  # signalled once already
            self.reason = reason
            self.child.send_signal(getattr(signal, reason.signal))
            grace = PEER_FAILED_GRACE_S if reason.cause == "peer" else self.grace_s
            self.kill_at = time.monotonic() + grace

    def overdue(self) -> None:
        with self.lock:
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                self._kill()

    def _kill(self) -> None:
        self.kill_at = None
        try:
            os.killpg(self.child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pump(stream: Any, name: str, pending: list[tuple[str, str]], last: dict[str, str], lock: threading.Lock,
         tail: deque[str] | None = None) -> None:
    """The child's lines, split on newlines only: a `\\r` progress update stays inside its line, as a
    terminal would keep it on one line, not one line per update. `last` keeps the last one shown,
    without torch's rank mark; `tail`, if given, the last lines."""
    for line in io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline="\n"):
        line = line.rstrip("\n").removesuffix("\r")
        with lock:
            pending.append((name, line))
            shown = unmark(settled(line)).strip()
            if shown:
                last[name] = shown
            if tail is not None:
                tail.append(line)


class Child:
    """The script, spawned and watched: threads collect its lines and note the moment it ends."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str], grace_s: float) -> None:
        self.proc = spawn(argv, cwd, env)
        self.stopper = Stopper(self.proc, grace_s)
        self.pending: list[tuple[str, str]] = []
        self.last = {"stdout": "", "stderr": ""}
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        """The last lines of its stderr."""
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.ended_at = 0.0
        """When it ended, exactly: the driver names the rank that failed first by this."""
        streams = ((self.proc.stdout, "stdout", None), (self.proc.stderr, "stderr", self.tail))
        self.pumps = [threading.Thread(target=pump, args=(stream, name, self.pending, self.last, self.lock, tail),
                                       daemon=True) for stream, name, tail in streams]
        for t in [*self.pumps, threading.Thread(target=self._wait, daemon=True)]:
            t.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()
        self.ended.set()

    def _send(self, send: Callable[[list[tuple[str, str]]], Any]) -> None:
        with self.lock:
            batch = self.pending[:]
            self.pending.clear()
        if batch:
            send(batch)

    def supervise(self, send: Callable[[list[tuple[str, str]]], Any], poll_s: float) -> int:
        """Until the script ends: its new lines to `send` every poll_s, and SIGKILL once a stop's
        grace ran out. Returns its returncode, once every line it wrote went to `send`."""
        try:
            while not self.ended.wait(poll_s):
                self._send(send)
                self.stopper.overdue()
        finally:
            if not self.ended.is_set():  # the agent itself is being torn down
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.ended.wait()
        for t in self.pumps:
            t.join(timeout=5)
        self._send(send)
        return self.proc.returncode

    def last_line(self) -> str:
        """Its last non-blank line, stderr's before stdout's."""
        return self.last["stderr"] or self.last["stdout"]

    def error(self, error_file: str) -> tuple[ScriptError | None, bool]:
        """Why it failed, and whether it ended on an uncaught exception: what torch's `@record` wrote
        (it did), else the last traceback it printed (it did if only exit noise came after it)."""
        with self.lock:
            if recorded := read_error_file(error_file):
                return recorded, True
            tail = list(self.tail)
            return last_traceback(tail), ended_on_traceback(tail)
