"""The driver's private local Ray (no --address): a token-secured `ray start` head under a keeper
(keeper.py) that ends all of it when the driver ends, however it ends, and says which part died
when the head dies under the run.

The keeper is spawned at the very start of a command, so the head comes up while the driver imports
torch and checks the request; the driver joins it by address once it listens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.session import keeper
from raytrain_ddp.driver.session.head import (
    HEAD_PORTS, START_TRIES, NodeExited, free_ports, head_command, head_env, last_said, new_token, with_fresh_ports,
)

UP_TIMEOUT_S = 90.0
"""How long the head may take to start (as the test heads get: a busy 2-core machine is slow)."""
UP_LINE = "Ray runtime started"
"""What `ray start` prints once its node is up (ray/scripts/scripts.py)."""
STOP_TIMEOUT_S = keeper.GRACE_S + 6.0
"""How long the driver waits for the keeper to end the head's every process at a normal exit."""


def runs_dir() -> Path:
    """/tmp/raytrain-<uid>, where every private Ray of this user lives; refused if another user owns it."""
    base = Path(tempfile.gettempdir()) / f"raytrain-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if base.stat().st_uid != os.getuid():
        raise ConfigError(f"{base} belongs to another user; remove it, or set TMPDIR to a directory of your own")
    return base


NO_DRAIN_WATCH = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""A private Ray's runs go without Ray Train's PreemptionWatcher: a process per run that imports Ray
Train (over a second of CPU, beside the ranks' model build) to pass on Ray's notice that it drains a
node. No one drains a private Ray's one node: only this driver holds its token. Set in the head's
environment, which the controller inherits, and not the driver's: Ray Train would ship a driver's
RAY_TRAIN_* settings in a runtime_env, which the fast start leaves out (ray_compat/controller.py)."""


class PrivateRay:
    """One private head under its keeper, spawned at once; up(private) waits for it."""

    def __init__(self) -> None:
        # A short directory of its own: Ray's socket paths must stay under 107 bytes.
        self.directory = Path(tempfile.mkdtemp(prefix="k", dir=runs_dir()))  # 0700
        self.token = new_token(self.directory)
        self.env = head_env(self.token, NO_DRAIN_WATCH)
        port, *others = free_ports("127.0.0.1", HEAD_PORTS)
        self.address = f"127.0.0.1:{port}"
        read, self.pipe = os.pipe()
        # PR_SET_PDEATHSIG fires when the *thread* that spawned the keeper ends: only the main thread
        # lives as long as the process. The pipe's EOF alone tells the keeper of the process's end.
        main = threading.current_thread() is threading.main_thread()
        command = head_command(None, port, others, self.directory / "ray", "--include-dashboard=false")
        with (self.directory / "keeper.log").open("ab") as log:
            self.keeper = subprocess.Popen(
                [sys.executable, keeper.__file__, str(os.getpid()), str(read), "1" if main else "0",
                 str(self.directory), *command],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(read,),
                start_new_session=True,  # a Ctrl-C at the terminal is the driver's to pass on, not Ray's to get
            )
        os.close(read)

    @property
    def session_dir(self) -> Path:
        return self.directory / "ray" / "session_latest"

    def wait_up(self) -> None:
        """Until `ray start` says its node is up (a driver that joins before the raylet registers
        retries, for long on a busy machine); NodeExited if the keeper ended first."""
        log, deadline = self.directory / "ray-start.log", time.monotonic() + UP_TIMEOUT_S
        while UP_LINE not in (log.read_text(errors="replace") if log.exists() else ""):
            if self.keeper.poll() is not None:
                raise NodeExited(f"the private Ray's keeper exited with {self.keeper.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the private Ray did not start within {UP_TIMEOUT_S:g} s; its logs: {self.directory}")
            time.sleep(0.05)

    def lost(self) -> str | None:
        """Which part of the head died, in words, once it did; None while it runs."""
        said = self.directory / keeper.LOST
        if said.exists():
            return said.read_text().strip()
        status = self.keeper.poll()
        if status is None:
            return None
        how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        return f"the private Ray's keeper (pid {self.keeper.pid}) {how}"

    def suspect(self) -> bool:
        """Whether the keeper saw a part of the head go, before it can say which (lost())."""
        return (self.directory / keeper.DYING).exists() or self.keeper.poll() is not None

    def stop(self) -> None:
        """End the head and all its processes: the keeper does it when its pipe closes."""
        try:
            os.close(self.pipe)
        except OSError:  # closed already
            pass
        try:
            self.keeper.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.keeper.kill()


def up(private: PrivateRay) -> PrivateRay:
    """`private` once it listens, or a fresh one if its `ray start` failed (a port taken meanwhile),
    up to START_TRIES in all."""
    tried = [private]

    def start(attempt: int) -> PrivateRay:
        if attempt > 1:
            tried.append(PrivateRay())
        tried[-1].wait_up()
        return tried[-1]

    try:
        return with_fresh_ports(start, lambda: tried[-1].directory / "ray-start.log")
    except NodeExited:
        said = last_said(tried[-1].directory / "ray-start.log")
        raise RuntimeError(f"the private Ray did not start ({START_TRIES} tries): {said or 'no output'}; "
                           f"its logs: {tried[-1].directory}") from None
