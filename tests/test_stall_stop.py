"""A stalled run still stops, and recovers where it may: a stop the ranks cannot answer ends them
after --stop-grace-s (with the stall report), and under --max-failures a stall is a failure Ray Train
restarts the worker group from (doctor/stall_watch.py's StallWatch, driver/run/news.py's RunNews.stop_overdue). Validation is
watched too, and a stop waits for validation that moves (sink.py's phases)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for

from raytrain_ddp.checkpoint.files import latest_checkpoint
from raytrain_ddp.errors import EXIT_STOPPED

STUCK_PY = """\
import threading
from pathlib import Path

import torch.distributed as dist
from torch import nn

MARK = Path({mark!r})
ONCE = {once!r}


class StuckOnRank1(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, num_classes))
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            # ONCE: only the first worker group's rank 1 blocks; the restarted one finds the mark
            if self.forwards == 5 and dist.get_rank() == 1 and not (ONCE and MARK.exists()):
                MARK.write_text("stuck")
                threading.Event().wait()  # the fault: rank 1 never comes back
        return self.body(x)
"""
RUN = ["--model", "stuck:StuckOnRank1", "--workers", "2", "--epochs", "1", "--train-samples", "320",
       "--val-samples", "32", "--batch-size", "16", "--data-workers", "0", "--progress", "plain",
       "--checkpoint-every-steps", "2"]
"""10 optimizer steps; checkpoints at steps 2 and 4, before rank 1 blocks in its 5th forward."""
GRACE_S = 5


def stuck_model(tmp_path: Path, once: bool) -> Path:
    """Writes stuck.py into tmp_path (the CLI ships it from there); returns the file rank 1 writes as it blocks."""
    mark = tmp_path / "stuck.mark"
    (tmp_path / "stuck.py").write_text(STUCK_PY.format(mark=str(mark), once=once))
    return mark


@pytest.mark.e2e
def test_sigterm_to_a_stalled_run_ends_it_after_the_grace_with_the_report_and_exit_75(ray_head, tmp_path: Path):
    mark = stuck_model(tmp_path, once=False)
    run_dir = tmp_path / "runs" / "stuck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", *RUN, "--stall-timeout", "600", "--stop-grace-s", str(GRACE_S),
         "--storage-path", str(tmp_path / "runs"), "--name", "stuck"],
        env=ray_head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(mark, proc)
        time.sleep(2)  # rank 0 is in the step's all-reduce, waiting for rank 1 for good
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=GRACE_S + 60)
    finally:
        proc.kill()
    took = time.monotonic() - signalled
    assert proc.returncode == EXIT_STOPPED, out[-2000:] + err[-3000:]
    assert took < GRACE_S + 30, f"{took:.0f} s after SIGTERM"
    assert "got SIGTERM: checkpointing at the next agreed step" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped: SIGTERM got no answer: the ranks reached no agreed step within --stop-grace-s {GRACE_S} s"), last
    assert "rank 1 (" in last and "stuck.py" in last and "StuckOnRank1.forward" in last, last
    assert "The last checkpoint, checkpoint_" in last and "same --storage-path and --name stuck) to resume from it" in last, last
    assert (run_dir / "stall" / "rank0.txt").exists() and (run_dir / "stall" / "rank1.txt").exists()
    assert "StuckOnRank1.forward" in (run_dir / "stall" / "rank1.txt").read_text()
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.is_dir()


@pytest.mark.e2e
def test_under_max_failures_a_stall_restarts_the_group_from_its_checkpoint_and_the_run_finishes(ray_head, tmp_path: Path):
    stuck_model(tmp_path, once=True)
    run_dir = tmp_path / "runs" / "once"
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "run", *RUN, "--stall-timeout", "10", "--max-failures", "1",
         "--storage-path", str(tmp_path / "runs"), "--name", "once"],
        env=ray_head.env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "the ranks were ended: Ray Train restarts them from the latest checkpoint" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    [stall] = summary["stalls"]
    assert stall["culprits"] == [1] and stall["stacks"] == str(run_dir / "stall"), stall
    assert stall["quiet_s"] >= 10 and "StuckOnRank1.forward" in stall["line"], stall
    assert (run_dir / "stall" / "rank1.txt").exists()
    assert [event["why"] for event in summary["resizes"]] == ["a worker group restarted after a stall"]
    assert summary["final"]["epoch"] == 1


VALIDATION_PY = """\
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

MARK = Path({mark!r})


class InValidation(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        if not self.training:
            MARK.touch()
            if {hang!r} and dist.get_rank() == 1:
                threading.Event().wait()  # the fault: rank 1 never finishes its first validation batch
            time.sleep({sleep!r})
        return self.body(x)
"""


def validation_model(tmp_path: Path, hang: bool, sleep: float) -> Path:
    """Writes validation.py into tmp_path; returns the file a rank touches as it validates a batch."""
    mark = tmp_path / "validating.mark"
    (tmp_path / "validation.py").write_text(VALIDATION_PY.format(mark=str(mark), hang=hang, sleep=sleep))
    return mark


@pytest.mark.e2e
def test_a_rank_stuck_in_validation_is_a_stall_named_in_one_line(ray_head, tmp_path: Path):
    validation_model(tmp_path, hang=True, sleep=0.0)
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "run", "--model", "validation:InValidation", "--workers", "2",
         "--epochs", "1", "--train-samples", "64", "--val-samples", "64", "--batch-size", "16", "--data-workers", "0",
         "--progress", "plain", "--stall-timeout", "10", "--storage-path", str(tmp_path / "runs"), "--name", "val"],
        env=ray_head.env, cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stalled (the epoch's validation did not move for 1"), last
    assert "rank 1 (" in last and "InValidation.forward" in last and "all_reduce" in last, last
    assert "InValidation.forward" in (tmp_path / "runs" / "val" / "stall" / "rank1.txt").read_text()


@pytest.mark.e2e
def test_a_stop_in_validation_that_moves_waits_for_it_past_the_grace(ray_head, tmp_path: Path):
    """Validation of 10 batches of 1 s a rank, SIGTERM as it starts, a grace of 3 s: the stop is
    answered at the next step, after the epoch's validation and checkpoint, and nothing is lost."""
    mark = validation_model(tmp_path, hang=False, sleep=1.0)
    run_dir = tmp_path / "runs" / "slowval"
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", "--model", "validation:InValidation", "--workers", "2",
         "--epochs", "2", "--train-samples", "64", "--val-samples", "320", "--batch-size", "16", "--data-workers", "0",
         "--progress", "plain", "--stop-grace-s", "3", "--storage-path", str(tmp_path / "runs"), "--name", "slowval"],
        env=ray_head.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(mark, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_STOPPED, out[-2000:] + err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "got no answer" not in last and "with a checkpoint at epoch 2" in last, last
    assert not (run_dir / "stall").exists()


GONE_PY = """\
import json, socket, subprocess, sys, time
from pathlib import Path

import ray

from raytrain_ddp.doctor.ranks import RankProcess
from raytrain_ddp.doctor.stall_watch import StallWatch
from raytrain_ddp.driver.run.sink import MetricsSink

ray.init(logging_level="ERROR")
sink = MetricsSink.remote()
ray.get(sink.step.remote(epoch=1, step=1, loss=1.0, at=time.time(), samples_per_s=1.0))
gone = subprocess.Popen(["true"])
# Exited but not reaped: a real rank's pid whose process is gone, and no other process can take it.
while open(f"/proc/{gone.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.05)
time.sleep(1.5)  # rank 0's last beat is now past the 1 s timeout
ranks = [RankProcess(0, socket.gethostname(), ray.util.get_node_ip_address(), gone.pid)]
watch = StallWatch(sink, 1.0, Path(sys.argv[1]), print)
watch.check(ranks)
quiet, *_ = ray.get(sink.quiet.remote())
gone.wait()
print(json.dumps({"quiet": quiet, "stalls": len(watch.stalls)}))
"""


@pytest.mark.e2e
def test_a_silent_group_whose_processes_are_gone_is_no_stall(ray_head, tmp_path: Path):
    """Ray Train ending or restarting a worker group (after a failure, a resize, our own end of a
    stalled group) leaves rank 0 silent too: the watch must neither fail the run nor count a stall,
    and counts again from now."""
    proc = subprocess.run([sys.executable, "-c", GONE_PY, str(tmp_path)], env=ray_head.env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["stalls"] == 0 and seen["quiet"] is not None and seen["quiet"] < 1.0, seen
    assert not (tmp_path / "stall").exists()
