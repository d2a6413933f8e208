"""Shared fixtures: one real local Ray head for the whole session, and a way to drive the real CLI.

Ray takes ~8 s to start on the CI machine, so end-to-end tests share one head started with
`ray start --head --block` (its own process group, so teardown stops exactly this cluster) and run
`raytrain run --address` against it, as a user on Slurm or any existing cluster would.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAD_CPUS = 2


@dataclass
class RayHead:
    address: str
    env: dict[str, str]
    """Environment for a driver of this cluster: its address and its token."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_head() -> RayHead:
    # A short temp dir: Ray's socket paths must stay under 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    os.chmod(tmp, 0o700)
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    port = free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    env.pop("RAY_ADDRESS", None)
    ray_bin = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray_bin), "start", "--head", "--block",
            f"--port={port}", "--node-ip-address=127.0.0.1",
            f"--num-cpus={HEAD_CPUS}", "--num-gpus=0",
            "--object-store-memory=200000000",
            "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={tmp / 'ray'}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for_port("127.0.0.1", port, head, timeout_s=90)
        yield RayHead(address=address, env={**env, "RAY_ADDRESS": address})
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"Ray head did not listen on {host}:{port} within {timeout_s} s")


def raytrain(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None):
    """Run the real CLI as a user would, as `python -m raytrain_ddp`; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", *args],
        env=env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


TINY = ["--epochs", "1", "--train-samples", "256", "--val-samples", "64", "--batch-size", "32",
        "--data-workers", "0", "--progress", "plain"]
"""A run small enough for CI: the point is the plumbing, not the model."""
