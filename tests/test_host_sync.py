"""The ranks at full speed: no host sync inside a training step (worker/host_sync.py), and ranks, with
their loader workers, at nice 0 on a Ray that raytrain starts (driver/session/connect.py FULL_PRIORITY)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TINY

from raytrain_ddp.doctor.ranks import RankProcess, ranks_from
from raytrain_ddp.driver.run.news import niced
from raytrain_ddp.worker import host_sync


def test_the_wall_refuses_a_read_back_and_a_device_scalar_outside_a_named_point(monkeypatch):
    monkeypatch.setenv(host_sync.CHECK_ENV, "1")
    loss = torch.ones(())
    with host_sync.wall(torch.device("cpu")):
        with pytest.raises(host_sync.HostSyncError, match="read back"):
            loss.item()
        with pytest.raises(host_sync.HostSyncError, match="copies Python data"):
            torch.tensor(3, device=loss.device)
        with host_sync.allowed():
            assert loss.item() == 1.0 and float(torch.tensor(2.0, device="cpu")) == 2.0
        with host_sync.allowed(when=False), pytest.raises(host_sync.HostSyncError):
            bool(loss)
        assert (loss * 3).sum().shape == ()  # work that stays on the device passes
    assert loss.item() == 1.0  # the wall is down after the block


def test_without_the_check_the_wall_lets_everything_pass(monkeypatch):
    monkeypatch.delenv(host_sync.CHECK_ENV, raising=False)
    with host_sync.wall(torch.device("cpu")):
        assert torch.tensor(1.0, device="cpu").item() == 1.0


def test_the_count_takes_torchs_sync_warnings_and_shows_the_others(recwarn):
    """What torch's "warn" mode says of each sync on a GPU (here said by hand: a CPU has no syncs) is
    counted, every time, even where Python's filters would show a repeat once; other warnings still show."""
    warnings.simplefilter("default")
    with host_sync.counted() as seen:
        for _ in range(3):
            warnings.warn(f"{host_sync.SYNC_WARNING} (function copy_)", UserWarning)
        warnings.warn("something else", UserWarning)
    assert seen == [3]
    assert [str(w.message) for w in recwarn] == ["something else"]


def test_niced_ranks_get_one_line_that_names_the_fix():
    where = lambda host, nice: RankProcess(0, host, "10.0.0.1", 1, nice)
    assert niced([where("a", 0), where("b", -5)]) is None
    assert niced(ranks_from([{"hostname": "a", "ip": "x", "pid": 1}])) is None  # an announcement without the field
    line = niced([where("a", 0), where("b", 15), where("c", 15)])
    assert line.startswith("2 of 3 ranks (on b, c) run at nice 15") and "RAY_worker_niceness=0" in line


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # field 19


def children_of(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


@pytest.mark.e2e
def test_a_private_ray_runs_its_ranks_and_loader_workers_at_nice_0_with_no_host_sync_in_a_step(tmp_path):
    """A real run on the private local Ray (no --address), every step behind the wall: a host sync
    outside the named points fails the run. While it trains, the ranks' niceness, and their loader
    workers', are read from /proc."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    env[host_sync.CHECK_ENV] = "1"
    args = [*TINY, "--workers", "2", "--train-samples", "4096", "--data-workers", "1", "--epochs", "1",
            "--storage-path", str(tmp_path), "--name", "nice"]
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_ddp", "run", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: dict[int, tuple[int, list[int]]] = {}  # rank pid -> (its nice, its loader workers' nices)
    workers = tmp_path / "nice" / "workers.json"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not (seen and all(k for _, k in seen.values())):
        if workers.exists():
            for rank in json.loads(workers.read_text())["ranks"]:
                try:
                    seen[rank["pid"]] = (nice_of(rank["pid"]), [nice_of(k) for k in children_of(rank["pid"])])
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    pass  # a loader worker between its start and its exit
        time.sleep(0.1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert len(seen) == 2 and all(kids for _, kids in seen.values()), f"never saw the ranks' loader workers: {seen}"
    assert all(nice == 0 and kids == [0] * len(kids) for nice, kids in seen.values()), seen
    ranks = json.loads(workers.read_text())["ranks"]
    assert [r["nice"] for r in ranks] == [0, 0]  # as each rank saw itself
    assert "run at nice" not in out + err
