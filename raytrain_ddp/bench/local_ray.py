"""A private, token-secured Ray head on this machine, for tests and benchmarks.

`ray start --head --block` runs in its own process group, so stopping it stops exactly this cluster
and never another user's (no node-wide `ray stop`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from raytrain_ddp.driver.session.head import NodeExited, free_ports, head_command, head_env, new_token, with_fresh_ports


@dataclass
class Head:
    address: str
    env: dict[str, str]
    """Environment for a driver of this cluster: RAY_ADDRESS and its token."""
    dashboard_url: str | None = None
    """http://127.0.0.1:PORT of the dashboard and Jobs API, where asked for."""
    session_dir: Path | None = None
    """Ray's session directory (its `logs/` has every worker process's log)."""


@contextmanager
def local_head(
    num_cpus: int, extra_env: dict[str, str] | None = None, num_gpus: int = 0, dashboard: bool = False,
    ray: str | None = None,
) -> Iterator[Head]:
    """A head on 127.0.0.1 with its own token; with `dashboard`, the Jobs API too (ray[default]).
    `ray`: the `ray` command to start it with (another release's), default this Python's."""
    # A short temp dir: Ray's socket paths must stay under 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    os.chmod(tmp, 0o700)
    base_env = head_env(new_token(tmp), extra_env)
    if dashboard:
        # A job's `python` is the first on the head's PATH, as on a cluster whose image has Ray.
        base_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base_env.get('PATH', '')}"

    def start(attempt: int) -> tuple[subprocess.Popen, Head]:
        port, url_port, autoscaler_metrics, dashboard_metrics, *others = free_ports("127.0.0.1", 11)
        env, url, web = dict(base_env), None, ["--include-dashboard=false"]
        if dashboard:
            url = f"http://127.0.0.1:{url_port}"
            web = ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={url_port}"]
            env |= {"AUTOSCALER_METRIC_PORT": str(autoscaler_metrics), "DASHBOARD_METRIC_PORT": str(dashboard_metrics)}
        shutil.rmtree(tmp / "ray", ignore_errors=True)  # a failed try's session
        proc = spawn(
            head_command(ray, port, others, tmp / "ray", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                         "--object-store-memory=200000000", *web),
            env, tmp / "ray-start.log",
        )
        try:
            wait_for_port("127.0.0.1", port, proc, timeout_s=90)
            if url is not None:
                wait_for_dashboard(url, proc, timeout_s=120)
        except BaseException:
            stop_group(proc)
            raise
        address = f"127.0.0.1:{port}"
        return proc, Head(address=address, env={**env, "RAY_ADDRESS": address}, dashboard_url=url,
                          session_dir=tmp / "ray" / "session_latest")

    try:
        proc, head = with_fresh_ports(start, lambda: tmp / "ray-start.log")
        try:
            yield head
        finally:
            stop_group(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def joined_node(head: Head, num_cpus: int, timeout_s: float = 180) -> Iterator[None]:
    """A second Ray node on this machine that joins `head` (with its token), as a node of a real
    cluster would; the block starts once the head counts it alive, and it leaves when the block ends.
    Its own temp dir: joined nodes on one host would otherwise share a session dir, and a second
    one's plasma socket clashes with the first's."""
    tmp = Path(tempfile.mkdtemp(prefix="rtn-", dir="/tmp"))  # short: Ray's socket paths stay < 107 bytes

    def start(attempt: int) -> subprocess.Popen:
        ports = [
            f"--{flag}={number}"
            for flag, number in zip(
                ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
                 "dashboard-agent-grpc-port", "runtime-env-agent-port"),
                free_ports("127.0.0.1", 6),
            )
        ]
        workers = random.randrange(30000, 40000, 100)
        shutil.rmtree(tmp / "ray", ignore_errors=True)  # a failed try's session
        proc = spawn(
            [
                str(Path(sys.executable).with_name("ray")), "start", "--block", f"--address={head.address}", *ports,
                f"--min-worker-port={workers}", f"--max-worker-port={workers + 99}", "--node-ip-address=127.0.0.1",
                f"--num-cpus={num_cpus}", "--num-gpus=0", "--object-store-memory=100000000", "--disable-usage-stats",
                f"--temp-dir={tmp / 'ray'}",
            ],
            {k: v for k, v in head.env.items() if k != "RAY_ADDRESS"}, tmp / "ray-start.log",
        )
        try:
            wait_until_joined(head, tmp / "ray", proc, timeout_s)
        except BaseException:
            stop_group(proc)
            raise
        return proc

    try:
        proc = with_fresh_ports(start, lambda: tmp / "ray-start.log")
        try:
            yield
        finally:
            stop_group(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start --block` in its own process group, its output appended to `log` (read when it fails)."""
    with log.open("a") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# `ray start` returns before its raylet has registered with the head, and on 2 busy cores a raylet
# that waits too long for its dashboard agent aborts: a run started meanwhile sees one node fewer.
# The node is known by its plasma socket, which lives under its own temp dir.
JOINED = """
import sys, time, ray
ray.init(logging_level="ERROR")
deadline = time.monotonic() + float(sys.argv[2])
while not any(n["Alive"] and n["ObjectStoreSocketName"].startswith(sys.argv[1]) for n in ray.nodes()):
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.2)
"""


def wait_until_joined(head: Head, tmp: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    waiter = subprocess.Popen([sys.executable, "-c", JOINED, str(tmp), str(timeout_s)], env=head.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while waiter.poll() is None:
        if proc.poll() is not None:
            waiter.kill()
            raise NodeExited(f"ray start of a joined node exited with {proc.returncode} before it joined")
        time.sleep(0.2)
    if waiter.returncode != 0:
        raise TimeoutError(f"a joined node was not alive at the head within {timeout_s} s: {waiter.stderr.read()[-500:]}")


STOP_TIMEOUT_S = 8.0
"""How long a node has to stop after SIGTERM before its whole process group is SIGKILLed."""


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a `ray start --block` and everything it started (its own process group), and only that."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group has exited already
        proc.wait()
        return
    try:
        # A started node stops in ~2 s (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0); `ray start` ignores
        # SIGTERM until its node is up, so a head stopped seconds after it began would wait here.
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NodeExited(f"ray start exited with {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"Ray head did not listen on {host}:{port} within {timeout_s} s")


def wait_for_dashboard(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Up once it answers at all: 401 without a token is an answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NodeExited(f"ray start exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the Ray dashboard did not answer at {url} within {timeout_s} s")
