"""How we start a Ray head on this machine (the private Ray of a run without --address, and the test
and benchmark heads): its fresh token, its environment, its ports, its `ray start` command, and the
retries with fresh ports when another process took one first."""

from __future__ import annotations

import os
import random
import secrets
import socket
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, TypeVar

FULL_PRIORITY = {"RAY_worker_niceness": "0"}
"""The environment of every Ray we start (the private local one, the test and benchmark heads): its
workers, our ranks and their loader workers, run at nice 0 as torchrun's do. Ray's default, 15,
gives a rank 36/1024 of the CPU weight of any nice-0 process beside it (cluster/ray_node.sh too)."""


def new_token(directory: Path) -> Path:
    """A fresh token for a head we start, in `directory` (which should be 0700), readable by us alone."""
    token = directory / "token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    return token


def head_env(token: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a head we start: token auth with `token`, our ranks at nice 0, and none of
    the variables that would point it (or its jobs) at another cluster."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stop in ~2 s, not 30
        **FULL_PRIORITY,
        **(extra_env or {}),
    }
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    return env


HEAD_PORTS = 8
"""free_ports a head_command takes: the GCS port, then one for each of its other servers."""


def head_command(ray: str | None, port: int, others: list[int], temp_dir: Path, *flags: str) -> list[str]:
    """`ray start --head --block` on 127.0.0.1 with every port explicit (`port` the GCS's, `others`
    seven more): Ray's servers share a taken port silently, and a second head on the default Ray
    Client port (10001) would answer for the first one at random. `ray`: the `ray` command, default
    this Python's; `flags`: resources, dashboard."""
    ports = [
        f"--{flag}={number}"
        for flag, number in zip(
            ("node-manager-port", "object-manager-port", "ray-client-server-port", "metrics-export-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port"),
            others,
        )
    ]
    workers = random.randrange(20000, 30000, 100)  # a worker-port block of its own, most likely
    return [
        ray or str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
        f"--port={port}", *ports, f"--min-worker-port={workers}", f"--max-worker-port={workers + 99}",
        "--node-ip-address=127.0.0.1", *flags, "--disable-usage-stats", f"--temp-dir={temp_dir}",
    ]


NODE_PORTS = range(11000, 20000)
"""Where a node's ports are picked: above Ray's defaults (6379, 8265, 10001), below the nodes'
worker-port blocks (20000-39999) and the OS's ephemeral range (32768 on, on Linux), where any
outgoing connection may take a port between our picking it and Ray's binding it."""
START_TRIES = 3
"""How many times a node is started, with fresh ports each time, before its failure is the caller's:
another process may still bind a port between our picking it and Ray's binding it, and `ray start`
then exits 1."""


class NodeExited(RuntimeError):
    """`ray start` exited before its node was up."""


def free_ports(host: str, count: int) -> list[int]:
    """`count` different TCP ports free on `host` now, from NODE_PORTS: each socket stays bound until
    all are picked, so no port is handed out twice."""
    with ExitStack() as stack:
        ports = []
        for port in random.sample(NODE_PORTS, len(NODE_PORTS)):
            s = stack.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"fewer than {count} free ports on {host} in {NODE_PORTS}")


T = TypeVar("T")


def with_fresh_ports(start: Callable[[int], T], log: Callable[[], Path]) -> T:
    """`start(attempt)` again, up to START_TRIES times, while its node exits before it is up; then the
    error says what `ray start` said last (in the file `log()` names once the last try failed)."""
    for attempt in range(1, START_TRIES + 1):
        try:
            return start(attempt)
        except NodeExited as exited:
            if attempt == START_TRIES:
                said = last_said(log())
                raise NodeExited(f"{exited} ({START_TRIES} tries, each with fresh ports){f': {said}' if said else ''}") from None
    raise AssertionError("unreachable")


def last_said(log: Path) -> str:
    """The last line a `ray start` wrote to `log`, cut to 300 characters; empty if it wrote none."""
    said = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return said[-1][:300] if said else ""
