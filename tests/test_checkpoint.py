"""Never lose work: preemption and resume, a killed worker, a NaN loss, --no-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import raytrain

from raytrain_ddp.metrics import read_csv

pytestmark = pytest.mark.e2e

# 2 ranks x 32 steps per epoch: long enough to be stopped mid-epoch, short enough for CI.
RUN = ["--workers", "2", "--train-samples", "2048", "--val-samples", "256", "--batch-size", "32",
       "--data-workers", "0", "--progress", "plain", "--scheduler", "none"]


def start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "run", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_preempted_run_resumes_to_the_same_result(ray_head, tmp_path):
    common = [*RUN, "--epochs", "2", "--storage-path", str(tmp_path)]
    whole = raytrain("run", *common, "--name", "whole", env=ray_head.env)
    assert whole.returncode == 0, whole.stderr[-2000:]

    # Slurm's warning signal arrives while epoch 1 trains: checkpoint, stop, exit 75.
    proc = start([*common, "--name", "cut"], ray_head.env)
    wait_for(tmp_path / "cut" / "workers.json", proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-2000:]
    assert "run the same command again" in err

    again = raytrain("run", *common, "--name", "cut", env=ray_head.env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from the checkpoint at epoch" in again.stdout
    cut, ref = read_csv(tmp_path / "cut" / "metrics.csv"), read_csv(tmp_path / "whole" / "metrics.csv")
    assert [r["epoch"] for r in cut] == ["1", "2"]
    for a, b in zip(cut, ref):
        # Every sample of each epoch trained exactly once, resumed epoch included ...
        assert a["samples"] == b["samples"] == "2048"
        # ... and the same data order and RNG give the same model, up to float summation order.
        for key in ("train_loss", "val_loss", "val_acc"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-3, abs=1e-4), key


def test_killed_worker_restarts_from_the_checkpoint(ray_head, tmp_path):
    args = [*RUN, "--epochs", "3", "--max-failures", "1", "--storage-path", str(tmp_path), "--name", "k"]
    proc = start(args, ray_head.env)
    run_dir = tmp_path / "k"
    wait_for(run_dir / "metrics.csv", proc)  # epoch 1 done and checkpointed
    victim = json.loads((run_dir / "workers.json").read_text())["ranks"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert [r["epoch"] for r in read_csv(run_dir / "metrics.csv")] == ["1", "2", "3"]
    pids = [r["pid"] for r in json.loads((run_dir / "workers.json").read_text())["ranks"]]
    assert victim not in pids  # a new worker group finished the run


def test_nan_loss_stops_and_names_the_step(ray_head, tmp_path):
    proc = raytrain("run", *RUN, "--epochs", "1", "--lr", "1e30", "--momentum", "0",
                    "--storage-path", str(tmp_path), "--name", "nan", env=ray_head.env)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "loss became NaN or inf at epoch 1 step" in line and "--lr" in line
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "nan").glob("checkpoint_*"))  # nothing saved after the bad step


def test_no_resume_moves_the_old_run_aside(ray_head, tmp_path):
    old = tmp_path / "r"
    old.mkdir()
    (old / "metrics.csv").write_text("precious\n")
    proc = raytrain("run", "--no-resume", "--dry-run", "--storage-path", str(tmp_path), "--name", "r")
    assert proc.returncode == 0
    assert old.exists()  # --dry-run changes nothing
    proc = raytrain("run", *RUN, "--epochs", "1", "--train-samples", "256", "--no-resume",
                    "--storage-path", str(tmp_path), "--name", "r", env=ray_head.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [aside] = tmp_path.glob("r.old-*")
    assert (aside / "metrics.csv").read_text() == "precious\n"
    assert read_csv(old / "metrics.csv")[0]["epoch"] == "1"


def test_worker_killed_for_memory_says_so(tmp_path):
    # A head whose memory monitor thinks any use is too much: Ray's real OOM killer fires.
    from raytrain_ddp.tools.head import local_head

    with local_head(num_cpus=2, extra_env={"RAY_memory_usage_threshold": "0.01",
                                           "RAY_memory_monitor_refresh_ms": "100"}) as head:
        proc = raytrain("run", *RUN, "--epochs", "1", "--storage-path", str(tmp_path), env=head.env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "ran out of memory" in line and "--batch-size" in line, proc.stderr[-2000:]
