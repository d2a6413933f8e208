"""`raytrain stack` (driver/look/stack.py) on a run that is not running: one line that says so. The stacks
of a running one: tests/test_launch_stall.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import free_port, raytrain


def record(runs: Path, name: str, address: str, pid: int) -> None:
    (runs / name).mkdir(parents=True)
    ranks = [{"hostname": "here", "ip": "127.0.0.1", "pid": pid}]
    (runs / name / "workers.json").write_text(json.dumps({"ranks": ranks, "ray_address": address}))


def test_a_run_whose_cluster_is_gone_is_not_running(tmp_path):
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    record(tmp_path / "runs", "old", address, os.getpid())
    proc = raytrain("stack", "--storage-path", str(tmp_path / "runs"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: run old is not running: the Ray cluster it ran on ({address}) does not answer"


def test_no_run_to_look_at_is_one_line(tmp_path):
    proc = raytrain("stack", "nope", "--storage-path", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no running record of run nope"), proc.stderr


@pytest.mark.e2e
def test_a_run_whose_ranks_are_gone_is_not_running(ray_head, tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    record(tmp_path / "runs", "done", ray_head.address, gone.pid)
    proc = raytrain("stack", "done", "--storage-path", str(tmp_path / "runs"), env=ray_head.env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: run done is not running: none of its ranks' processes is there ({gone.pid} on here)"
